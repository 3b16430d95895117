"""OneWriteProtocol: uvicorn's httptools protocol with each response's head and body in one write.

The unit tests drive the head holder with a transport that records writes.
The others run a real uvicorn server with the protocol (in a thread, on a free
port) and speak HTTP/1.1 over raw sockets, so nothing a client library does
hides a missing, late or doubled head: keep-alive, pipelining, HEAD,
``Expect: 100-continue``, a streamed (chunked) body, a large body, and an app
that fails after starting its response.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("httptools")
uvicorn = pytest.importorskip("uvicorn")

from neuropod_serving.server.http import JOIN_BELOW, OneWriteProtocol, _HeadHolder  # noqa: E402

# --- the head holder ------------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class _Cycle:
    response_started = False


def test_head_and_body_go_out_in_one_write() -> None:
    transport, cycle = _Transport(), _Cycle()
    holder = _HeadHolder(transport, cycle)
    holder.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response starts: not held
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    cycle.response_started = True
    holder.write(b"HEAD")
    assert len(transport.writes) == 1
    holder.write(b"BODY")
    assert transport.writes[1:] == [b"HEADBODY"]
    holder.write(b"MORE")  # later writes (a streamed body) pass straight through
    assert transport.writes[2:] == [b"MORE"]
    assert not holder.is_closing()  # everything else is the transport's own


def test_a_large_body_is_not_copied_to_join_the_head() -> None:
    transport, cycle = _Transport(), _Cycle()
    holder = _HeadHolder(transport, cycle)
    cycle.response_started = True
    body = b"x" * JOIN_BELOW
    holder.write(b"HEAD")
    holder.write(body)
    assert transport.writes == [b"HEAD", body]


def test_closing_writes_a_held_head_first() -> None:
    transport, cycle = _Transport(), _Cycle()
    holder = _HeadHolder(transport, cycle)
    cycle.response_started = True
    holder.write(b"HEAD")
    holder.close()
    assert transport.writes == [b"HEAD"] and transport.closed


# --- a real server -------------------------------------------------------------


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    path = scope["path"]
    if path == "/fail-after-start":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        raise RuntimeError("the app failed after starting its response")
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one,", b"two,", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    reply = b"L" * (2 * JOIN_BELOW) if path == "/large" else b"echo:" + body
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(reply))]})  # fmt: skip
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(_app, http=OneWriteProtocol, lifespan="off", log_level="critical", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    sock.close()


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _read_response(conn: socket.socket, buffer: bytearray) -> tuple[bytes, dict[str, str], bytes]:
    """One response from ``conn`` (``buffer`` keeps what arrived past it): status line, headers, body."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed mid-head: {bytes(buffer)!r}"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.decode().split(":", 1) for line in lines)}
    buffer[:] = rest
    if "content-length" in headers:
        size = int(headers["content-length"])
        while len(buffer) < size:
            chunk = conn.recv(65536)
            assert chunk, "the connection closed mid-body"
            buffer += chunk
        body = bytes(buffer[:size])
        del buffer[:size]
        return status, headers, body
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        while b"\r\n" not in buffer:
            buffer += conn.recv(65536)
        size_line, _, rest = bytes(buffer).partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            rest += conn.recv(65536)
        body += rest[:size]
        buffer[:] = rest[size + 2 :]
        if size == 0:
            return status, headers, body


def test_keep_alive_requests_each_get_their_whole_response(port: int) -> None:
    with _connect(port) as conn:
        buffer = bytearray()
        for i in range(5):
            conn.sendall(_post("/echo", b"request %d" % i))
            status, _, body = _read_response(conn, buffer)
            assert status == b"HTTP/1.1 200 OK" and body == b"echo:request %d" % i


def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    with _connect(port) as conn:
        conn.sendall(b"".join(_post("/echo", b"p%d" % i) for i in range(4)))
        buffer = bytearray()
        assert [_read_response(conn, buffer)[2] for _ in range(4)] == [b"echo:p%d" % i for i in range(4)]


def test_head_request_gets_its_head(port: int) -> None:
    with _connect(port) as conn:
        conn.sendall(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            assert chunk, "no head for a HEAD request"
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 OK") and b"content-length: 5" in data.lower()


def test_expect_100_continue_is_answered_before_the_body_is_sent(port: int) -> None:
    with _connect(port) as conn:
        body = b"sent after 100 Continue"
        head = f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
        conn.sendall(head.encode())
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = conn.recv(65536)
            assert chunk, "the server closed instead of answering 100 Continue"
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        conn.sendall(body)
        buffer = bytearray(interim.partition(b"\r\n\r\n")[2])
        status, _, reply = _read_response(conn, buffer)
        assert status == b"HTTP/1.1 200 OK" and reply == b"echo:" + body


def test_streamed_and_large_bodies_arrive_whole(port: int) -> None:
    with _connect(port) as conn:
        buffer = bytearray()
        conn.sendall(_post("/stream", b""))
        status, _headers, body = _read_response(conn, buffer)
        assert status == b"HTTP/1.1 200 OK" and body == b"one,two,three"
        conn.sendall(_post("/large", b""))
        status, _, body = _read_response(conn, buffer)
        assert status == b"HTTP/1.1 200 OK" and body == b"L" * (2 * JOIN_BELOW)


def test_app_failing_after_its_head_closes_the_connection_after_the_head(port: int) -> None:
    with _connect(port) as conn:
        conn.sendall(_post("/fail-after-start", b""))
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        # As with uvicorn's own protocol: the head went out, then the connection closed.
        assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b"\r\n\r\n")
