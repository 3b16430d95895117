"""The REST transport of remote models: HTTP/1.1 keep-alive connections, pooled per server.

Python's ``http.client`` parses the answers; requests are written here so
that a small request goes out in one ``send()`` (``http.client`` writes the
head and the body apart), and answers are read into a ``bytearray`` so that
the outputs are writable views of it (no copy).

No server is trusted: a ``Content-Length`` is a claim, so the buffer grows
with the bytes that actually arrive (pages of up to :data:`FIRST_READ_BYTES`
are written only as bytes come, then the buffer doubles), and a ``timeout`` is a deadline for the whole call, connecting,
sending and every read included: a server that trickles its answer a byte at
a time cannot hold a call past it.
Tensors go as Triton's binary tensor extension when the server lists it
(``neuropod serve``, Triton), as JSON otherwise (MLServer).

Streams (``infer_stream``) POST to ``/v2/models/{m}[/versions/{v}]/infer_stream`` on a
connection of their own and read its Server-Sent Events as they arrive: one ``data:`` event of
an inference response's JSON per response, ``{"error": ...}`` for an error that ends the stream.
Closing the stream closes the connection, which stops the model on the server.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from neuropod import _json
from neuropod.errors import RemoteError
from neuropod_serving.client._errors import HTTP_CODES, looks_like_tls, remote_error, stream_error_code
from neuropod_serving.client._target import Target
from neuropod_serving.protocol import HEADER_LENGTH, ProtocolError, build_infer_request, parse_infer_response
from neuropod_serving.protocol.events import EventReader, event_error

# Bodies up to this size go out in the same send() as the head.
_ONE_WRITE = 64 * 1024
# Idle connections kept per server (more are closed when they come back).
_MAX_IDLE = 32
#: An answer's buffer is taken at its Content-Length up to this size, its pages written only as
#: the bytes arrive; past it, the buffer doubles as they do. A false claim costs address space
#: up to this much, and memory only for what was sent.
FIRST_READ_BYTES = 16 << 20
# Answers up to this size are read into a bytearray of their Content-Length (zeroed first: cheap).
_SMALL = 64 * 1024
# The first buffer of an answer without a Content-Length (chunked, or until the server closes).
_UNKNOWN_LENGTH_FIRST = 64 * 1024
# The most a stream's read takes at once (what has arrived, up to this).
_STREAM_READ = 64 * 1024
# The most of a refused stream's answer read for its message.
_STREAM_ERROR_BYTES = 64 * 1024


class _DeadlineReader(io.RawIOBase):
    """The socket's reading side for ``http.client``, each read bounded by the call's deadline
    (a socket timeout alone bounds each read, not their sum)."""

    def __init__(self, sock: socket.socket, deadline: float | None) -> None:
        self._sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed while the answer was still arriving")
            self._sock.settimeout(left)
        return self._sock.recv_into(b)


class _Reading:
    """What ``http.client.HTTPResponse`` takes as its socket: it only calls ``makefile``."""

    def __init__(self, reader: _DeadlineReader) -> None:
        self._reader = reader

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self._reader)


class _Connection:
    """One keep-alive connection."""

    def __init__(self, target: Target, context: ssl.SSLContext | None, server_name: str | None, deadline: float | None):
        sock = socket.create_connection((target.host, target.port), timeout=_left(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                sock.settimeout(_left(deadline))
                sock = context.wrap_socket(sock, server_hostname=server_name or target.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def roundtrip(self, head: bytes, body: bytes | None, deadline: float | None) -> tuple[http.client.HTTPResponse, Any]:
        """Send a request and read the whole answer by ``deadline``: (response, body as bytearray or bytes).

        :raises TimeoutError: the deadline passed.
        :raises http.client.IncompleteRead: the server closed before its Content-Length came.
        """
        sock = self.sock
        sock.settimeout(_left(deadline))  # sendall's timeout bounds the whole send
        if body is None:
            sock.sendall(head)
        elif len(body) <= _ONE_WRITE:
            sock.sendall(head + body)
        else:
            sock.sendall(head)
            sock.settimeout(_left(deadline))
            sock.sendall(body)
        response = http.client.HTTPResponse(_Reading(_DeadlineReader(sock, deadline)))  # type: ignore[arg-type]
        try:
            response.begin()
            data = _read_body(response, response.length)
        finally:
            response.close()  # the response's file, not the socket
        return response, data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no limit).

    :raises TimeoutError: it has passed.
    """
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


def _read_body(response: http.client.HTTPResponse, length: int | None) -> bytearray | memoryview:
    """The body, in memory that grows only as its bytes arrive: ``length`` bytes when the server
    announced a Content-Length, else all it sends (chunked, or until it closes).

    Up to :data:`FIRST_READ_BYTES` of a Content-Length is taken at once, as a buffer whose pages
    are not written before the bytes come (``np.empty``: no zero fill, so untouched pages cost no
    memory); past it, the buffer doubles when full, keeping what came. Small answers (the common
    case) get a plain ``bytearray``.

    :raises http.client.IncompleteRead: the server closed before ``length`` bytes came.
    """
    if length is not None and length <= _SMALL:
        data = bytearray(length)
        with memoryview(data) as view:
            got = 0
            while got < length:
                n = response.readinto(view[got:])
                if not n:
                    raise http.client.IncompleteRead(b"", length - got)
                got += n
        return data
    size = _UNKNOWN_LENGTH_FIRST if length is None else min(length, FIRST_READ_BYTES)
    buffer = np.empty(size, np.uint8)
    got = 0
    while True:
        view = memoryview(buffer)  # type: ignore[arg-type]
        while got < size:
            n = response.readinto(view[got:])
            if not n:
                break
            got += n
        if got < size:
            if length is not None:
                raise http.client.IncompleteRead(b"", length - got)
            return view[:got]
        if length is not None and got >= length:
            return view
        size = 2 * size if length is None else min(2 * size, length)
        grown = np.empty(size, np.uint8)
        grown[:got] = buffer[:got]
        buffer = grown


class HttpTransport:
    """Calls to one server for one model over REST; thread-safe (each call holds its own connection)."""

    def __init__(
        self,
        target: Target,
        *,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self.target = target
        self._context = ssl_context if target.tls else None
        if target.tls and self._context is None:
            self._context = ssl.create_default_context()
        self._server_name = tls_server_name
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        model = quote(target.model, safe="")
        self._model_path = f"/v2/models/{model}" + (f"/versions/{quote(target.version)}" if target.version else "")
        host = target.address if target.port != (443 if target.tls else 80) else target.host
        auth = f"Authorization: Bearer {auth_token}\r\n" if auth_token else ""
        self._common = f"Host: {host}\r\n{auth}User-Agent: neuropod-serving\r\n"
        self._infer_head = f"POST {self._model_path}/infer HTTP/1.1\r\n{self._common}"
        #: Whether the server takes Triton's binary tensor extension (it lists
        #: ``binary_tensor_data`` in its metadata; MLServer does not): learnt at load.
        self.binary: bool | None = None
        #: The model's bytes outputs, whose BYTES are the bytes sent (the loader sets them from the spec).
        self.bytes_outputs: frozenset[str] = frozenset()

    # --- connections ---------------------------------------------------------

    def _request(self, head: bytes, body: bytes | None, call: str, timeout: float | None) -> tuple[int, Any, Any]:
        """One request on a pooled connection: (status, headers, body), all of it within ``timeout``.
        A connection the server closed while it was idle is replaced once, transparently."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in (0, 1):
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            try:
                if conn is None:
                    conn = _Connection(self.target, self._context, self._server_name, deadline)
                response, data = conn.roundtrip(head, body, deadline)
            except TimeoutError as e:
                if conn is not None:
                    conn.close()
                detail = "the deadline passed" if str(e) in ("", "timed out") else str(e)
                raise remote_error(self.target, "deadline_exceeded", detail, call=call, timeout=timeout) from None
            except ssl.SSLError as e:
                if conn is not None:
                    conn.close()
                raise remote_error(self.target, "tls", str(e), call=call) from None
            except http.client.IncompleteRead as e:
                conn.close()  # type: ignore[union-attr]
                short = f" ({e.expected} bytes short)" if e.expected else ""
                raise remote_error(
                    self.target, "protocol",
                    f"the server closed the connection before the end of the answer it announced{short}", call=call,
                ) from None  # fmt: skip
            except (OSError, http.client.HTTPException) as e:
                if conn is not None:
                    conn.close()
                stale = isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError))
                if reused and stale and attempt == 0:
                    continue  # the server dropped the idle connection: try a new one
                code = "tls" if looks_like_tls(str(e)) else (
                    "protocol" if isinstance(e, http.client.HTTPException) and not stale else "unavailable"
                )  # fmt: skip
                raise remote_error(self.target, code, f"{type(e).__name__}: {e}", call=call) from None
            if response.will_close:
                conn.close()
            else:
                with self._lock:
                    if self._closed or len(self._idle) >= _MAX_IDLE:
                        conn.close()
                    else:
                        self._idle.append(conn)
            return response.status, response.headers, data
        raise AssertionError("unreachable")

    def _get(self, path: str, call: str, timeout: float | None, *, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        head = f"GET {path} HTTP/1.1\r\n{self._common}\r\n".encode("latin-1")
        status, _headers, data = self._request(head, None, call, timeout)
        if status not in ok:
            raise self._status_error(status, data, call)
        return status, _json_body(data) if data else None

    def _status_error(self, status: int, data: Any, call: str) -> RemoteError:
        parsed = _json_body(data)
        message = parsed.get("error") if isinstance(parsed, dict) else None
        if not isinstance(message, str):
            message = bytes(data[:500]).decode("utf-8", "replace") if data else ""
        return remote_error(self.target, HTTP_CODES.get(status, "internal" if status >= 500 else "invalid_argument"),
                            f"HTTP {status}: {message}" if message else f"HTTP {status}", call=call)  # fmt: skip

    # --- the calls -----------------------------------------------------------

    def metadata(self, timeout: float | None) -> dict[str, Any]:
        if self.binary is None:
            _, server = self._get("/v2", "server metadata", timeout)
            extensions = server.get("extensions") if isinstance(server, dict) else None
            self.binary = isinstance(extensions, list) and "binary_tensor_data" in extensions
        _, body = self._get(self._model_path, "model metadata", timeout)
        if not isinstance(body, dict):
            raise remote_error(self.target, "protocol", "the model metadata is not a JSON object", call="model metadata")
        return body

    def decoupled(self, timeout: float | None) -> bool | None:
        """Whether the model's configuration (Triton's ``GET .../config``) says it is decoupled;
        None when the server has no such route or does not answer it."""
        flags = self.config_flags(timeout)
        return None if flags is None else flags[0]

    def config_flags(self, timeout: float | None) -> tuple[bool, bool] | None:
        """Whether the model's configuration says it is decoupled, and whether it has
        ``sequence_batching`` (a stateful model); None when the server does not answer."""
        try:
            status, body = self._get(self._model_path + "/config", "model config", timeout, ok=(200, 400, 404, 501))
        except RemoteError:
            return None
        if status != 200 or not isinstance(body, dict):
            return None
        policy = body.get("model_transaction_policy")
        return isinstance(policy, dict) and policy.get("decoupled") is True, isinstance(body.get("sequence_batching"), dict)

    def ready(self, timeout: float | None) -> bool:
        # 200 ready; Triton and neuropod answer 400 (and MLServer 404/503) for a model that is not.
        status, _ = self._get(self._model_path + "/ready", "model ready", timeout, ok=(200, 400, 503))
        return status == 200

    def server(self, timeout: float | None) -> dict[str, Any]:
        status, _ = self._get("/v2/health/live", "server live", timeout, ok=(200, 503))
        _, meta = self._get("/v2", "server metadata", timeout)
        meta = meta if isinstance(meta, dict) else {}
        return {
            "live": status == 200,
            "name": meta.get("name", ""),
            "version": meta.get("version", ""),
            "extensions": list(meta.get("extensions") or []),
        }

    def infer(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], requested: Sequence[str] | None, timeout: float | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:  # fmt: skip
        content, extra = self._request_body(inputs, requested, parameters, self.binary is not False, "infer")
        if parameters and "sequence_id" in parameters:
            extra += sequence_header(parameters)
        head = f"{self._infer_head}{extra}Content-Length: {len(content)}\r\n\r\n".encode("latin-1")
        status, headers, data = self._request(head, content, "infer", timeout)
        if status != 200:
            raise self._status_error(status, data, "infer")
        try:
            return parse_infer_response(data, headers.get(HEADER_LENGTH), bytes_outputs=self.bytes_outputs).outputs
        except ProtocolError as e:
            raise remote_error(self.target, "protocol", str(e), call="infer") from None

    def _request_body(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None, binary_outputs: bool, call: str,
    ) -> tuple[bytes, str]:  # fmt: skip
        """An infer request's body (inputs as binary data where the server takes it) and its
        Content-Type header line (with the JSON header's length when binary data follows it).

        :raises RemoteError: an input the protocol cannot carry (``invalid_argument``).
        """
        try:
            body = build_infer_request(inputs, binary=self.binary is not False, outputs=requested,
                                       binary_outputs=binary_outputs, parameters=parameters)  # fmt: skip
        except ProtocolError as e:
            raise remote_error(self.target, "invalid_argument", f"the inputs cannot be sent: {e}", call=call) from None
        if body.json_length is not None:
            return body.content, f"Content-Type: application/octet-stream\r\n{HEADER_LENGTH}: {body.json_length}\r\n"
        return body.content, "Content-Type: application/json\r\n"

    def open_stream(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], requested: Sequence[str] | None, timeout: float | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> HttpStream:  # fmt: skip
        """POST one request to the model's ``infer_stream`` route on a new connection and read the
        answer's head; its events are read from the returned stream (``timeout``: a deadline for
        the whole stream). A refusal (an HTTP error status) is a RemoteError, as for :meth:`infer`."""
        target = self.target
        # Outputs as JSON, the form events carry.
        content, extra = self._request_body(inputs, requested, parameters, False, "infer_stream")
        head = (
            f"POST {self._model_path}/infer_stream HTTP/1.1\r\n{self._common}Accept: text/event-stream\r\n"
            f"{extra}Content-Length: {len(content)}\r\n\r\n"
        ).encode("latin-1")
        deadline = None if timeout is None else time.monotonic() + timeout
        conn: _Connection | None = None
        try:
            conn = _Connection(target, self._context, self._server_name, deadline)
            conn.sock.settimeout(_left(deadline))
            conn.sock.sendall(head + content)
            response = http.client.HTTPResponse(_Reading(_DeadlineReader(conn.sock, deadline)))  # type: ignore[arg-type]
            response.begin()
            if response.status != 200:
                data = response.read(_STREAM_ERROR_BYTES)
                raise self._status_error(response.status, data, "infer_stream")
            kind = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
            if kind != "text/event-stream":
                raise remote_error(target, "protocol", f"the stream's answer is {kind or 'untyped'}, not "
                                   "text/event-stream", call="infer_stream")  # fmt: skip
        except BaseException as e:
            if conn is not None:
                conn.close()
            if isinstance(e, (RemoteError, KeyboardInterrupt, SystemExit)):
                raise
            raise self._stream_error(e, timeout) from None
        return HttpStream(self, conn, response, timeout)

    def _stream_error(self, e: BaseException, timeout: float | None) -> RemoteError:
        """A transport fault of a stream as the RemoteError :meth:`_request` gives for a call's."""
        if isinstance(e, TimeoutError):
            detail = "the deadline passed" if str(e) in ("", "timed out") else str(e)
            return remote_error(self.target, "deadline_exceeded", detail, call="infer_stream", timeout=timeout)
        if isinstance(e, ssl.SSLError):
            return remote_error(self.target, "tls", str(e), call="infer_stream")
        if isinstance(e, http.client.HTTPException) and not isinstance(e, http.client.RemoteDisconnected):
            return remote_error(self.target, "protocol", f"{type(e).__name__}: {e}", call="infer_stream")
        code = "tls" if looks_like_tls(str(e)) else "unavailable"
        return remote_error(self.target, code, f"{type(e).__name__}: {e}", call="infer_stream")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class HttpStream:
    """The Server-Sent Events of one ``infer_stream`` request, as they arrive: iterate it (each
    item a dict of output arrays); :meth:`cancel` closes the connection from any thread."""

    def __init__(self, transport: HttpTransport, conn: _Connection, response: http.client.HTTPResponse,
                 timeout: float | None) -> None:  # fmt: skip
        self._transport = transport
        self._conn = conn
        self._response = response
        self._timeout = timeout
        self._reader = EventReader()
        self._ready: list[str] = []
        self._cancelled = False
        self._ended = False

    def __iter__(self) -> HttpStream:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        target = self._transport.target
        while not self._ready:
            if self._ended:
                raise StopIteration
            try:
                chunk = self._response.read1(_STREAM_READ)
            except BaseException as e:
                self._end()
                if self._cancelled and isinstance(e, (OSError, ValueError, http.client.HTTPException)):
                    raise StopIteration from None
                if isinstance(e, (OSError, http.client.HTTPException)):
                    raise self._transport._stream_error(e, self._timeout) from None
                raise
            if not chunk:
                self._end()
                if self._reader.incomplete and not self._cancelled:
                    raise remote_error(target, "protocol", "the stream ended in the middle of an event",
                                       call="infer_stream")  # fmt: skip
                raise StopIteration
            try:
                self._ready = self._reader.feed(chunk)
            except (ValueError, UnicodeDecodeError) as e:
                self._end()
                raise remote_error(target, "protocol", f"the stream's events cannot be read: {e}",
                                   call="infer_stream") from None  # fmt: skip
        data = self._ready.pop(0)
        problem: ProtocolError | None = None
        try:
            outputs: dict[str, np.ndarray[Any, Any]] | None = parse_infer_response(
                data.encode("utf-8"), bytes_outputs=self._transport.bytes_outputs
            ).outputs
        except ProtocolError as e:
            outputs, problem = None, e
        if outputs:
            return outputs
        # No outputs: the error that ends the stream, or an empty response.
        try:
            message = event_error(_json.loads(data))
        except ValueError:
            message = None
        if message is not None:
            self._end()
            raise remote_error(target, stream_error_code(message), message, call="infer_stream")
        if outputs is None:
            self._end()
            raise remote_error(target, "protocol", f"an event is not an inference response: {problem}",
                               call="infer_stream")  # fmt: skip
        return outputs

    def _end(self) -> None:
        self._ended = True
        self._ready = []
        self._conn.close()

    def cancel(self) -> None:
        """Close the connection: the server stops the model; a reader gets the end."""
        self._cancelled = True
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        except OSError:
            pass
        self._conn.close()


def _json_body(data: Any) -> Any:
    """A server's JSON answer, or None when it is not JSON. Read with the core's bounded reader:
    an answer nested past its depth limit must not end in a RecursionError."""
    try:
        return _json.loads(bytes(data).decode("utf-8")) if data else None
    except ValueError:  # not UTF-8, not JSON, too deep or too large
        return None


#: The header that repeats a request's sequence step where a router reads headers only (Ray
#: Serve's HTTP proxy routes a request before its body is read: see neuropod_serving.ray).
SEQUENCE_HEADER = "Neuropod-Sequence"


def sequence_header(parameters: Mapping[str, Any]) -> str:
    """The :data:`SEQUENCE_HEADER` line of a request whose parameters name a sequence: its id,
    start and end flags as a JSON list (``[5, true, false]``; a string id stays a JSON string)."""
    step = [parameters["sequence_id"], bool(parameters.get("sequence_start")), bool(parameters.get("sequence_end"))]
    text = json.dumps(step, ensure_ascii=True)
    return f"{SEQUENCE_HEADER}: {text}\r\n" if "\r" not in text and "\n" not in text else ""
