"""A lean HTTP/1.1 client for ``kvfit bench serve``'s streaming requests (asyncio streams, no
HTTP library per chunk).

Why: the load generator must not be what limits a serving benchmark. With httpx (its HTTP/1.1
parser, h11, is pure Python and handles every chunk of a chunked response) the client process
used ~130 µs of CPU per streamed event; on the H200 host a fake engine's run at 64 streams
kept the client at 100% of a core while the server process sat at 46% (docs/benchmarks.md).
Here a response body is read in large pieces and its chunked framing is split with
``bytes.find``; SSE events are cut at blank lines.

``ConnectionPool(host, port)`` keeps idle keep-alive connections for reuse (as many as were
in use at once: the caller bounds concurrency);
``pool.stream_post(path, body)`` is an async context manager yielding ``(status, events)``:
``events`` is an async iterator of ``(arrival_time, [event payloads])`` per read (a read may
carry several events, as the server's writes coalesce), payloads being the bytes after
``data: ``. A non-200 status comes with the body as one payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Optional


class HTTPStreamError(Exception):
    pass


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.buf = bytearray()

    async def fill(self) -> bool:
        data = await self.reader.read(1 << 16)
        if not data:
            return False
        self.buf += data
        return True

    async def read_head(self) -> tuple[int, dict[bytes, bytes]]:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if not await self.fill():
                raise HTTPStreamError("connection closed before the response headers")
        head = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[:end + 4]
        status = int(head[0].split(b" ", 2)[1])
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """Keep-alive connections to one server (a connection serves one request at a time)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._idle: list[_Conn] = []

    async def _get(self) -> _Conn:
        if self._idle:
            return self._idle.pop()
        return _Conn(*await asyncio.open_connection(self.host, self.port))

    @contextlib.asynccontextmanager
    async def stream_post(self, path: str, body: bytes):
        request = (b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                   b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                   % (path.encode(), self.host.encode(), self.port, len(body)) + body)
        reused = bool(self._idle)
        conn = await self._get()
        ok = False
        try:
            try:
                conn.writer.write(request)
                status, headers = await conn.read_head()
            except (HTTPStreamError, ConnectionError):
                if not reused:
                    raise
                # the server closed an idle keep-alive connection: once more on a new one
                conn.close()
                conn = _Conn(*await asyncio.open_connection(self.host, self.port))
                conn.writer.write(request)
                status, headers = await conn.read_head()
            reader = _Body(conn, headers)
            yield status, reader.events()
            ok = reader.done and headers.get(b"connection", b"").lower() != b"close"
        finally:
            if ok:
                self._idle.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()


class _Body:
    """One response body: chunked (a stream) or with a Content-Length (an error answer)."""

    def __init__(self, conn: _Conn, headers: dict[bytes, bytes]):
        self.conn, self.done = conn, False
        self.chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        n = headers.get(b"content-length")
        self.length: Optional[int] = int(n) if n is not None else None

    async def events(self) -> AsyncIterator[tuple[float, list[bytes]]]:
        conn = self.conn
        if not self.chunked:
            need = self.length or 0
            while len(conn.buf) < need:
                if not await conn.fill():
                    raise HTTPStreamError("connection closed inside the response body")
            body = bytes(conn.buf[:need])
            del conn.buf[:need]
            self.done = self.length is not None
            yield time.perf_counter(), [body]
            return
        sse = bytearray()
        buf = conn.buf
        while True:
            # take every complete chunk in the buffer
            pos, last = 0, False
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                start, end = eol + 2, eol + 2 + size
                if len(buf) < end + 2:
                    break
                if size == 0:
                    # no trailers from our server: the body ends with the empty line
                    pos, last = end + 2, True
                    break
                sse += buf[start:end]
                pos = end + 2
            del buf[:pos]
            if sse:
                cut = sse.rfind(b"\n\n")
                if cut >= 0:
                    events = [e[6:] for e in bytes(sse[:cut]).split(b"\n\n")
                              if e.startswith(b"data: ")]
                    del sse[:cut + 2]
                    if events:
                        yield time.perf_counter(), events
            if last:
                self.done = True
                return
            if not await conn.fill():
                raise HTTPStreamError("connection closed inside the stream")
