"""A lean HTTP/1.1 client for streamed (server-sent events) POSTs, on asyncio streams.

`atomrt bench serve` reads one event per token from every stream it has open: at 64 streams on a
fast server that is over ten thousand events a second, and a general-purpose client (httpx) spends
about 150 µs of the bench's one core on each, which then decides the figures instead of the server.
This client does only what the bench needs, in about a tenth of that: a POST with a JSON body, the
status, a chunked, sized or closing body, SSE framing, and connections kept alive for the next
request. http:// and https:// URLs; no proxies, redirects or compression.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any, Optional
from urllib.parse import urlsplit


class StreamError(Exception):
    """The server answered with something other than 200, or broke the protocol."""


class SSEClient:
    def __init__(self, base_url: str, connect_timeout: float = 30.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"{base_url}: only http:// and https:// URLs are supported")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: Optional[ssl.SSLContext] = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self.prefix = url.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> SSEClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl), self.connect_timeout
        )

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST `body` as JSON to `path` and yield the data of each event of the streamed answer
        (the `data:` lines of an event, joined). Raises StreamError for a status other than 200
        (with the start of the body) and for a malformed answer; OSError and
        asyncio.IncompleteReadError when the connection breaks."""
        payload = json.dumps(body).encode()
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        reader, writer = await self._connect()
        reusable = False
        try:
            writer.write(head + payload)
            status, headers = await _read_head(reader)
            chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            length = int(headers["content-length"]) if "content-length" in headers else None
            keep = headers.get("connection", "").lower() != "close"
            if status != 200:
                text = await _read_body(reader, chunked, length)
                raise StreamError(f"HTTP {status}: {text[:200]!r}")
            buffer = b""
            async for data in _body_pieces(reader, chunked, length):
                buffer += data
                if b"\r" in buffer:
                    buffer = buffer.replace(b"\r\n", b"\n")
                *complete, buffer = buffer.split(b"\n\n")
                for event in complete:
                    lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln[:5] == b"data:"]
                    if lines:
                        yield b"\n".join(lines)
            reusable = keep and (chunked or length is not None)
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise StreamError(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_pieces(
    reader: asyncio.StreamReader, chunked: bool, length: Optional[int]
) -> AsyncIterator[bytes]:
    """The body as it arrives: chunk by chunk, or up to Content-Length, or to the connection's
    end."""
    if chunked:
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise StreamError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif length is not None:
        while length > 0:
            data = await reader.read(min(length, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", length)
            length -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def _read_body(reader: asyncio.StreamReader, chunked: bool, length: Optional[int]) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, chunked, length)])
