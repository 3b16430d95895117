"""A local web server of packages for the download tests, well-behaved or misbehaving as told.

:class:`Site` says what it serves: ``files`` by name (the URL's path, without its query), with an
ETag (of the bytes answered, unless ``etag`` fixes one) and byte ranges (a ``Range`` is answered
206, ``Accept-Ranges: bytes`` sent; ``ranges=False``: ignored, as Python's own file server does).
The misbehaviours are its other fields. :func:`web_server` serves a site on a free port of
127.0.0.1 until its ``with`` ends, then shuts down and joins its thread.

Used by core/tests (imported by name) and by serving/tests (loaded from this file's path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclasses.dataclass
class Site:
    """What the server answers; the tests change it while it serves."""

    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    #: ``name?version=N`` answers ``versions[name][N]`` (404 for a version not there).
    versions: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    #: A load balancer whose nodes disagree: a HEAD answers ``files[name]``, a GET ``gets[name]``.
    gets: dict[str, bytes] = dataclasses.field(default_factory=dict)
    #: The first ranged GET of a name (a resumed download) sets ``gets[name]`` to this.
    switch_on_range: dict[str, bytes] = dataclasses.field(default_factory=dict)
    #: Names whose next GET stops halfway, the connection closed (a body over ``drop_over`` bytes).
    drop: set[str] = dataclasses.field(default_factory=set)
    drop_over: int = 0
    #: Names answered with this status (HEAD and GET), an empty body.
    status: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Names whose HEAD answers but every GET gets a 500.
    fail_gets: set[str] = dataclasses.field(default_factory=set)
    #: Names whose next ``flaky[name]`` GETs get a 500.
    flaky: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Names answered with this many zero bytes in 64 KiB chunks, no length; ``sent`` counts what went.
    chunked: dict[str, int] = dataclasses.field(default_factory=dict)
    sent: dict[str, int] = dataclasses.field(default_factory=dict)
    #: ``/<from>...`` redirects (302) to ``/<to>...``.
    redirects: dict[str, str] = dataclasses.field(default_factory=dict)
    #: One ETag and Last-Modified for every answer (validators that do not tell versions apart).
    etag: str | None = None
    last_modified: str | None = None
    ranges: bool = True

    def reset(self) -> None:
        """Back to an empty, well-behaved site."""
        vars(self).update(vars(Site()))


def etag_of(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _empty(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, head: bool) -> None:
        site = self.server.site
        parts = urlsplit(self.path)
        for old, new in site.redirects.items():
            if parts.path.startswith(old):
                self._empty(302, Location=new + self.path[len(old) :])
                return
        name = parts.path.lstrip("/")
        if name in site.status:
            self._empty(site.status[name])
            return
        if not head and (name in site.fail_gets or site.flaky.get(name, 0) > 0):
            if name in site.flaky:
                site.flaky[name] -= 1
            self._empty(500)
            return
        if name in site.chunked:
            self._chunks(name, head)
            return
        ranged = self.headers.get("Range") if site.ranges else None
        if not head and ranged and name in site.switch_on_range:
            site.gets[name] = site.switch_on_range.pop(name)
        version = parse_qs(parts.query).get("version")
        if version and name in site.versions:
            data = site.versions[name].get(version[0])
        else:
            data = site.files.get(name) if head else site.gets.get(name, site.files.get(name))
        if data is None:
            self._empty(404)
            return
        start, end = 0, len(data) - 1
        if ranged and ranged.startswith("bytes="):
            a, _, b = ranged[6:].partition("-")
            start = int(a) if a else 0
            end = min(int(b), len(data) - 1) if b else len(data) - 1
        body = data[start : end + 1]
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(len(body)))
        if site.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", site.etag or etag_of(data))
        if site.last_modified:
            self.send_header("Last-Modified", site.last_modified)
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if head:
            return
        if name in site.drop and len(body) > site.drop_over:
            site.drop.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)

    def _chunks(self, name: str, head: bool) -> None:
        site = self.server.site
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("ETag", '"endless"')
        self.end_headers()
        if head:
            return
        piece = b"\0" * (64 * 1024)
        try:
            for _ in range(site.chunked[name] // len(piece)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                site.sent[name] = site.sent.get(name, 0) + len(piece)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client stopped reading
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    site: Site


@contextlib.contextmanager
def web_server(site: Site) -> Iterator[str]:
    """``http://127.0.0.1:<port>``, serving ``site`` until the ``with`` ends."""
    with serving(_Handler, site) as base:
        yield base


@contextlib.contextmanager
def serving(handler: Callable[..., socketserver.BaseRequestHandler], site: Site | None = None) -> Iterator[str]:
    """``http://127.0.0.1:<port>``, each request answered by ``handler`` until the ``with`` ends
    (which shuts the server down and joins its thread)."""
    httpd = _Server(("127.0.0.1", 0), handler)
    httpd.site = site or Site()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
