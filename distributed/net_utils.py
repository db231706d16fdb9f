"""Addresses for one engine instance: this node's IP, free TCP ports, a private ipc:// directory.

Nothing here is hard-coded: every engine instance gets its own ports or socket directory, so two
engines (or two test runs) on one machine never collide.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid

logger = logging.getLogger(__name__)

# Unix socket paths are limited to 107 bytes (sun_path); keep the per-instance dir short.
_MAX_IPC_PATH = 100


def new_instance_id() -> str:
    """A short id naming one engine instance (socket directory, handshake probes)."""
    return uuid.uuid4().hex[:12]


def get_host_ip(preferred: str = "") -> str:
    """This node's address as seen by other nodes.

    `preferred` (from the environment registry, ATOMRT_HOST_IP) wins. Otherwise the source address
    of a route to a public address (a UDP connect sends no packet), then the hostname's address,
    then loopback.
    """
    if preferred:
        return preferred
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
            if ip and not ip.startswith("0."):
                return ip
    except OSError:
        pass
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if ip:
            return ip
    except OSError:
        pass
    logger.warning(
        "could not find this node's IP; using 127.0.0.1 (set ATOMRT_HOST_IP for multi-node)"
    )
    return "127.0.0.1"


def get_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_ipc_dir(instance: str) -> str:
    """A fresh private directory for this instance's Unix sockets (mode 0700)."""
    base = tempfile.gettempdir()
    if len(base) > _MAX_IPC_PATH - 40:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix=f"atomrt-{instance}-", dir=base)
    os.chmod(path, 0o700)
    return path


def ipc_address(ipc_dir: str, name: str) -> str:
    path = os.path.join(ipc_dir, name)
    if len(path) > _MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path too long ({len(path)} > {_MAX_IPC_PATH} bytes): {path}; set TMPDIR shorter"
        )
    return f"ipc://{path}"


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
