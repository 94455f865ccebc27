"""`PlainHttp`, the keep-alive client of the batch route: reuse, stale connections, bad answers.

A small asyncio TCP server on loopback plays the server, so each behaviour is exact.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from steprl.hosting.plain_http import PlainHttp


async def _serve(answers: list[bytes], *, close_after_each: bool = False):
    """A server that reads one request per answer (headers + Content-Length body) and replies."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(answers.pop(0))
                await writer.drain()
                if close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port, connections


def _ok(body: bytes = b'{"ok":1}') -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


def test_keeps_the_connection_alive_and_sends_headers() -> None:
    async def go():
        server, port, connections = await _serve([_ok(), _ok(b'{"ok":2}')])
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {"Authorization": "Bearer t"})
            first = await client.post("/v1/batch", b"{}", content_type="application/json", timeout=5)
            second = await client.post("/v1/batch", b"{}", content_type="application/json", timeout=5)
            await client.aclose()
            return first, second, connections

    first, second, connections = asyncio.run(go())
    assert first.status_code == 200 and first.json() == {"ok": 1} and second.json() == {"ok": 2}
    assert len(connections) == 1  # one kept-alive connection for both requests


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def go():
        server, port, connections = await _serve([_ok(), _ok()], close_after_each=True)
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {})
            await client.post("/x", b"{}", content_type="application/json", timeout=5)
            await asyncio.sleep(0.1)  # the server's FIN arrives: the idle connection is at EOF
            again = await client.post("/x", b"{}", content_type="application/json", timeout=5)
            await client.aclose()
            return again, connections

    again, connections = asyncio.run(go())
    assert again.status_code == 200 and len(connections) == 2


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"garbage\r\n\r\n", httpx.ReadError),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", httpx.ReadError),
    ],
)
def test_malformed_or_cut_answers_are_transport_errors(answer, error) -> None:
    async def go():
        server, port, _ = await _serve([answer], close_after_each=True)
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {})
            with pytest.raises(error):
                await client.post("/x", b"{}", content_type="application/json", timeout=5)
            assert client._idle == []  # a broken connection is never reused

    asyncio.run(go())


def test_no_answer_is_a_read_timeout_and_no_server_a_connect_error() -> None:
    async def go():
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)  # holds the connection, never answers
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {})
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/x", b"{}", content_type="application/json", timeout=0.2)
        with pytest.raises(httpx.ConnectError):
            await PlainHttp(f"http://127.0.0.1:{port}", {}).post("/x", b"", content_type="a/b", timeout=1)

    asyncio.run(go())


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="plain http"):
        PlainHttp("https://127.0.0.1:1", {})


def test_each_call_in_a_batch_keeps_its_own_deadline() -> None:
    """A call whose deadline passes first times out then; the batch waits for the later one."""
    from steprl.hosting.coalesce import Coalescer

    async def go():
        loop = asyncio.get_running_loop()
        got_request = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            got_request.set()
            await asyncio.sleep(30)  # never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            coalescer = Coalescer(f"http://127.0.0.1:{port}", {})
            t0 = loop.time()
            short = asyncio.ensure_future(coalescer.call("a", "step", {"action": "x", "seq": 1}, 0.2))
            long = asyncio.ensure_future(coalescer.call("b", "step", {"action": "y", "seq": 1}, 1.5))
            with pytest.raises(TimeoutError):
                await short
            short_at = loop.time() - t0
            assert got_request.is_set() and coalescer.counter.batches_sent == 1  # one batch for both
            assert not long.done()
            with pytest.raises((TimeoutError, httpx.TimeoutException)):
                await long
            return short_at, loop.time() - t0

    short_at, long_at = asyncio.run(go())
    assert 0.15 < short_at < 1.0 and long_at >= 1.4


def _chunked(*chunks: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return head + body + b"0\r\n\r\n"


def test_a_chunked_answer_is_read_line_by_line_and_the_connection_reused() -> None:
    async def go():
        # a line split across chunks, two lines in one chunk, a blank line, no final newline
        answer = _chunked(b'{"a":', b'1}\n{"b":2}\n\n{"c"', b":3}")
        server, port, connections = await _serve([answer, _chunked(b"x\ny\n"), _ok()])
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {})
            lines: list[bytes] = []
            reply = await client.post(
                "/v1/batch", b"{}", content_type="application/json", timeout=5, on_line=lines.append
            )
            collected = await client.post("/v1/batch", b"{}", content_type="application/json", timeout=5)
            after = await client.post("/v1/batch", b"{}", content_type="application/json", timeout=5)
            await client.aclose()
            return reply, lines, collected, after, connections

    reply, lines, collected, after, connections = asyncio.run(go())
    assert reply.status_code == 200 and reply.content == b""
    assert lines == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
    assert collected.content == b"x\ny\n"  # without on_line: the whole body
    assert after.json() == {"ok": 1} and len(connections) == 1


def test_a_malformed_chunk_is_a_read_error() -> None:
    async def go():
        bad = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"
        server, port, _ = await _serve([bad])
        async with server:
            with pytest.raises(httpx.ReadError):
                await PlainHttp(f"http://127.0.0.1:{port}", {}).post(
                    "/x", b"{}", content_type="application/json", timeout=5
                )

    asyncio.run(go())


def test_a_streamed_batch_that_misses_a_call_answers_it_as_malformed() -> None:
    from steprl.hosting.coalesce import Coalescer

    async def go():
        good = b'{"index":1,"status":200,"body":{"closed":true},"headers":{}}\n'
        answer = _chunked(good, b"not json\n", b'{"index":7,"status":200}\n', b'{"index":1,"status":500}\n')
        server, port, _ = await _serve([answer])
        async with server:
            coalescer = Coalescer(f"http://127.0.0.1:{port}", {})
            return await asyncio.gather(
                coalescer.call("a", "close", None, 5.0), coalescer.call("b", "close", None, 5.0)
            )

    missed, answered = asyncio.run(go())
    assert (answered.status, answered.data) == (200, {"closed": True})  # the first line for it wins
    assert missed.status == 200 and missed.data is None and "no result" in missed.text


def test_an_ndjson_answer_in_one_piece_goes_line_by_line_and_other_bodies_do_not() -> None:
    async def go():
        lines_body = b'{"a":1}\n{"b":2}\n'
        whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ncontent-length: %d\r\n\r\n%s" % (
            len(lines_body),
            lines_body,
        )
        plain_chunked = _chunked(b'{"x":1}\n').replace(b"application/x-ndjson", b"application/json")
        server, port, _ = await _serve([whole, plain_chunked])
        async with server:
            client = PlainHttp(f"http://127.0.0.1:{port}", {})
            seen: list[bytes] = []
            first = await client.post("/x", b"{}", content_type="a/b", timeout=5, on_line=seen.append)
            second = await client.post("/x", b"{}", content_type="a/b", timeout=5, on_line=seen.append)
            await client.aclose()
            return first, second, seen

    first, second, seen = asyncio.run(go())
    assert seen == [b'{"a":1}', b'{"b":2}'] and first.content == b""
    assert second.content == b'{"x":1}\n'  # not NDJSON: collected, never split


def test_a_streamed_line_may_carry_a_burst_of_results() -> None:
    from steprl.hosting.coalesce import Coalescer

    async def go():
        burst = b'[{"index":2,"status":200,"body":{"closed":true}},7,{"index":0,"status":404,"body":{}}]\n'
        server, port, _ = await _serve(
            [_chunked(burst, b'[{"index":1,"status":200,"body":{"closed":true}}]\n')]
        )
        async with server:
            coalescer = Coalescer(f"http://127.0.0.1:{port}", {})
            return await asyncio.gather(*(coalescer.call(i, "close", None, 5.0) for i in "abc"))

    answers = asyncio.run(go())
    assert [a.status for a in answers] == [404, 200, 200]  # a non-result item (7) is skipped
    assert all(a.data is not None for a in answers)
