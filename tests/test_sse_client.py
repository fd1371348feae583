"""The bench's streaming HTTP client against a tiny asyncio server: chunked SSE split into
events (chunk and event boundaries anywhere), keep-alive reuse, a Content-Length error body,
and a retry when the server closed an idle connection."""

import asyncio

from kvfit.bench.sse_client import ConnectionPool

EVENTS = [b'{"a": 1}', b'{"b": "x\\n"}', b"[DONE]"]


def _chunked(payload: bytes, cuts) -> bytes:
    out, pos = b"", 0
    for c in list(cuts) + [len(payload)]:
        piece = payload[pos:c]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
        pos = c
    return out + b"0\r\n\r\n"


async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0]
            .split(b":")[1])
    return await reader.readexactly(n)


def test_chunked_events_keepalive_and_errors():
    sse = b"".join(b"data: " + e + b"\n\n" for e in EVENTS)
    served = []

    async def handler(reader, writer):
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            served.append(body)
            if body == b"bad":
                msg = b'{"error": "no"}'
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(msg), msg))
            else:  # chunk boundaries inside events and inside the "data: " prefix
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for i, part in enumerate([_chunked(sse, [3, 11, 12, 30])[k:k + 7] for k in
                                          range(0, 200, 7)]):
                    writer.write(part)
                    if i % 3 == 0:
                        await writer.drain()
                        await asyncio.sleep(0)
            await writer.drain()

    async def run():
        server, port = await _serve(handler)
        pool = ConnectionPool("127.0.0.1", port)
        got = []
        for body in (b"one", b"two"):
            async with pool.stream_post("/x", body) as (status, events):
                assert status == 200
                got.append([p async for _, ps in events for p in ps])
        assert len(pool._idle) == 1  # one connection, reused
        async with pool.stream_post("/x", b"bad") as (status, events):
            assert status == 400
            assert [p async for _, ps in events for p in ps] == [b'{"error": "no"}']
        pool.close()
        server.close()
        return got

    got = asyncio.run(run())
    assert got == [EVENTS, EVENTS] and served == [b"one", b"two", b"bad"]


def test_retries_once_when_an_idle_connection_was_closed():
    calls = []

    async def handler(reader, writer):
        body = await _read_request(reader)
        calls.append(body)
        payload = _chunked(b"data: [DONE]\n\n", [])
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + payload)
        await writer.drain()
        writer.close()  # no keep-alive, without saying so

    async def run():
        server, port = await _serve(handler)
        pool = ConnectionPool("127.0.0.1", port)
        for _ in range(3):
            async with pool.stream_post("/x", b"q") as (status, events):
                assert status == 200 and [p async for _, ps in events for p in ps] == [b"[DONE]"]
        pool.close()
        server.close()

    asyncio.run(run())
    assert calls == [b"q"] * 3
