"""The driver process's ZAP handler for the tcp:// step channel's CURVE sockets
(distributed/transport.py): it admits a client while its public key belongs to a channel this
process has open."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "atomrt-step-channel"  # the ZAP domain of the driver's CURVE sockets
ZAP_REBIND_TIMEOUT_S = 5.0


def _start_authenticator() -> ThreadAuthenticator:
    """Start the process's ZAP handler. The endpoint it binds is the context's one ZAP address,
    which a handler stopped just before still holds until ZeroMQ has closed its socket, a moment
    after `stop()` returns: the bind is retried until that is done (a bounded wait)."""
    deadline = time.monotonic() + ZAP_REBIND_TIMEOUT_S
    while True:
        auth = ThreadAuthenticator(zmq.Context.instance())
        try:
            auth.start()
            return auth
        except zmq.ZMQError as e:
            auth.stop()
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise RuntimeError(
                    f"step channel: cannot start the CURVE authenticator (ZAP handler): {e}"
                ) from e
            time.sleep(0.01)


class _Admission:
    """The driver process's ZAP handler: a CURVE client is admitted while its public key belongs to
    a channel this process has open. One per process, because ZAP is per ZeroMQ context and every
    socket here shares `zmq.Context.instance()`; its thread runs while a key is admitted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[bytes, int] = {}  # client public key (z85) -> sockets using it
        self._auth: Optional[ThreadAuthenticator] = None
        self.refused = 0  # CURVE handshakes refused, for logs and tests

    def admit(self, client_public: str) -> None:
        with self._lock:
            if self._auth is None:
                auth = _start_authenticator()
                auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
                self._auth = auth
            key = client_public.encode()
            self._keys[key] = self._keys.get(key, 0) + 1

    def revoke(self, client_public: str) -> None:
        with self._lock:
            key = client_public.encode()
            left = self._keys.get(key, 0) - 1
            if left > 0:
                self._keys[key] = left
            else:
                self._keys.pop(key, None)
            if not self._keys and self._auth is not None:
                self._auth.stop()
                self._auth = None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP asks (from its thread) whether the client key `key` (z85) may connect."""
        with self._lock:
            if key in self._keys:
                return True
            self.refused += 1
            refused = self.refused
        if refused == 1 or refused % 1000 == 0:
            logger.warning(
                "step channel: refused a CURVE handshake from a peer without this engine's "
                "client key (%d refused so far)",
                refused,
            )
        return False


ADMISSION = _Admission()
