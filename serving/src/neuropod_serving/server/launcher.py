"""One server process of ``neuropod serve``: load the models, open the REST, gRPC and metrics
ports, print the start-up table and serve until interrupted (:func:`serve_models`), with what it
checks first: the bearer token and TLS files, the ports, the ``[server]`` extra's libraries.

Starlette, uvicorn and grpc are imported when the ports open, after the models loaded: a bad
package fails the start before the web stack is paid for, and a missing ``[server]`` extra is
reported by :func:`check_server_libraries` rather than as an ImportError.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import socket
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from neuropod.errors import NeuropodError, PluginNotInstalledError
from neuropod.plugins import pip_install
from neuropod_serving.defaults import (
    DEFAULT_MAX_GRPC_STREAMS,
    DEFAULT_MAX_OPEN_STREAMS,
    DEFAULT_MAX_SEQUENCE_IDLE_US,
    DEFAULT_MAX_SEQUENCES,
    DEFAULT_STREAM_BUFFER,
)
from neuropod_serving.server.admission import ModelLimits
from neuropod_serving.server.batching import BatchPolicy
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.lifecycle import in_several_processes
from neuropod_serving.server.metrics import ServerMetrics, WorkerRunWatch
from neuropod_serving.server.registry import MODEL_VERSION, ModelRegistry
from neuropod_serving.server.sequence_batching import SequenceLimits
from neuropod_serving.server.shm_regions import SharedMemoryRegistry
from neuropod_serving.server.streams import StreamLimits


def read_token(path: Path) -> str:
    """The bearer token in ``path``: its first line, without surrounding whitespace.

    :raises NeuropodError: the file cannot be read or holds no token.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NeuropodError(f"--auth-token-file {path}: cannot read it ({e})") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise NeuropodError(f"--auth-token-file {path} is empty; put the token on its first line")
    return token


def read_tls(cert: Path | None, key: Path | None) -> tuple[bytes, bytes] | None:
    """The PEM certificate chain and key, or None without TLS.

    :raises NeuropodError: only one of the two is given, one cannot be read, or they
        are not a PEM certificate and its unencrypted private key.
    """
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if cert is not None else ("--tls-key", "--tls-cert")
        raise NeuropodError(f"{given} needs {missing} too: TLS takes a certificate and its private key")
    pems = []
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise NeuropodError(f"{flag} {path}: cannot read it ({e})") from None
        if b"-----BEGIN " not in data:
            raise NeuropodError(f"{flag} {path} is not PEM (no '-----BEGIN' line)")
        pems.append(data)
    _check_tls(cert, key)
    return pems[0], pems[1]


def _check_tls(cert: Path, key: Path) -> None:
    """Load the pair as a TLS server would, so a bad one fails the start naming its flag
    (not later, inside uvicorn or gRPC, as a bare OpenSSL 'PEM lib' error)."""

    def encrypted() -> bytes:  # OpenSSL would otherwise prompt on the terminal
        raise NeuropodError(f"--tls-key {key} is encrypted; give an unencrypted key (openssl pkey -in KEY -out PLAIN)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=str(cert))
    except ssl.SSLError:
        raise NeuropodError(f"--tls-cert {cert} holds no readable PEM certificate") from None
    try:
        context.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise NeuropodError(f"--tls-key {key} is not the private key of --tls-cert {cert}") from None
        raise NeuropodError(f"--tls-key {key} holds no readable PEM private key") from None


def startup_table(registry: object, engine: object | None = None) -> str:
    """One row per model: name, platform, backend, device, batching and inputs."""
    assert isinstance(registry, ModelRegistry)
    versioned = any(s.version != MODEL_VERSION for s in registry)
    rows = [("MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS")]
    for served in sorted(registry, key=lambda s: (s.name, int(s.version))):
        m = served.model
        inputs = ", ".join(f"{s.name}: {s.dtype}{list(s.shape)}".replace("'", "") for s in m.inputs)
        if isinstance(engine, Engine):
            on, why = engine.batched(served.name, served.version)
            batched = f"yes ({why})" if on and why else "yes" if on else f"no ({why})"
        else:
            batched = "no"
        name = f"{served.name} (version {served.version})" if versioned else served.name
        rows.append((name, m.platform, m.backend.id, m.device, batched, inputs))
    n = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:n], widths)), r[n]]).rstrip() for r in rows)


#: Modules `neuropod serve` imports, from the [server] extra.
SERVER_MODULES = (
    "starlette", "uvicorn", "httptools", "grpc", "google.protobuf", "prometheus_client", "orjson",
)  # fmt: skip


def check_server_libraries() -> None:
    missing = []
    for module in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing (google)
            found = False
        if not found:
            missing.append(module)
    if missing:
        install = pip_install("'neuropod-serving[server]'")
        raise PluginNotInstalledError(
            f"`neuropod serve` needs the server's libraries ({', '.join(missing)} not installed): {install}"
        )


def serve_models(
    args: argparse.Namespace,
    token: str | None,
    tls: tuple[bytes, bytes] | None,
    out: TextIO,
    *,
    group: Any = None,
    on_serving: Any = None,
    table: bool = True,
) -> None:
    """Load every package and serve them until interrupted: the whole server of one process,
    or one process of ``--processes`` (``group``, a :class:`~neuropod_serving.processes.GroupMember`).

    :param on_serving: called once the ports are open and requests are served.
    :param table: print the start-up table (unless ``--quiet``).
    """
    registry = ModelRegistry.load(args.paths, workers=args.workers, policy=getattr(args, "version_policy", None))
    batching = BatchPolicy(args.max_batch_size, args.max_queue_delay_us / 1e6) if args.max_batch_size > 1 else None
    limits = ModelLimits(args.max_concurrent_runs, args.max_queued_requests)
    shared_memory = None
    if getattr(args, "allow_client_shm", False):
        shared_memory = SharedMemoryRegistry()
    metrics = ServerMetrics()
    stream_limits = StreamLimits(
        getattr(args, "max_open_streams", DEFAULT_MAX_OPEN_STREAMS), getattr(args, "stream_buffer", DEFAULT_STREAM_BUFFER)
    )
    sequences = SequenceLimits(
        getattr(args, "max_sequence_idle_us", DEFAULT_MAX_SEQUENCE_IDLE_US),
        getattr(args, "max_sequences", DEFAULT_MAX_SEQUENCES),
    )
    engine = Engine(
        registry, batching=batching, metrics=metrics, limits=limits, shared_memory=shared_memory,
        stream_limits=stream_limits, sequences=sequences,
    )  # fmt: skip
    metrics.live_sequences = engine.live_sequences
    metrics.step_statistics = registry.step_statistics
    if args.workers > 1 and not (group is not None and group.index != 0):  # one process of a group says it

        def run_time(name: str) -> tuple[int, float] | None:
            measured = getattr(engine.get(name).model, "worker_run_time", None)
            return measured if isinstance(measured, tuple) else None

        metrics.watch = WorkerRunWatch(run_time, args.workers)
    if group is not None:
        for served in registry:
            if getattr(served.model, "stateful", False):
                engine.close()
                raise in_several_processes(served.model.name)
        engine.group = group
        group.attach(engine)
    poll = getattr(args, "poll_interval", None)
    if poll is not None:
        engine.start_polling(poll)
    try:
        if table and not args.quiet:
            print(startup_table(registry, engine), file=out)
        _serve(engine, args, token, tls, out, group=group, on_serving=on_serving)
    finally:
        engine.close()


#: How long a thread may keep the GIL while another waits (Python's default is 5 ms).
#: A server's threads hold it in short bursts, and a model run lets it go: with
#: the default, a gRPC thread whose run has just finished can wait milliseconds
#: to get it back. Measured on the tiny model, gRPC at concurrency 8, one core:
#: about 2,100 requests/s at 5 ms, 2,400 at 1 ms, 2,500 at 0.2 ms, 2,600 at 0.05 ms.
GIL_SWITCH_S = 0.0001


def serving_line(
    args: argparse.Namespace, models: int, token: str | None, tls: tuple[bytes, bytes] | None, *, processes: int = 1
) -> str:
    """Where the server listens, the line printed once it does."""
    scheme = "https" if tls else "http"
    auth = "bearer token required" if token else "no authentication"
    where = [f"REST {scheme}://{show_host(args.host)}:{args.http_port}/v2"]
    if args.grpc_port:
        where.append(f"gRPC {show_host(args.host)}:{args.grpc_port}{' (TLS)' if tls else ''}")
    if args.metrics_port:
        where.append(f"metrics {scheme}://{show_host(args.host)}:{args.metrics_port}/metrics")
    each = f" in {processes} processes" if processes > 1 else ""
    return f"serving {models} model(s){each}: {', '.join(where)} ({auth})"


def _serve(
    engine: Any,
    args: argparse.Namespace,
    token: str | None,
    tls: tuple[bytes, bytes] | None,
    out: TextIO,
    *,
    group: Any = None,
    on_serving: Any = None,
) -> None:
    import uvicorn  # lazy: uvicorn, imported once the models loaded

    # lazy: starlette, imported once the models loaded (a bad package fails the start before it)
    from neuropod_serving.server.app import create_app, metrics_only

    sys.setswitchinterval(GIL_SWITCH_S)
    shared = group is not None  # the other processes of --processes listen on the same ports
    app = create_app(engine, auth_token=token, max_request_bytes=args.max_request_bytes)
    sockets = [_bind(args.host, args.http_port, "--http-port", reuse_port=shared)]
    if args.metrics_port:
        sockets.append(_bind(args.host, args.metrics_port, "--metrics-port", reuse_port=shared))
        app = metrics_only(app, port=args.metrics_port)

    async def main() -> None:
        grpc_server = None
        with tempfile.TemporaryDirectory(prefix="neuropod-tls-") as tmp:
            ssl: dict[str, Any] = {}
            if tls is not None:
                # uvicorn reads files: copies private to this process, removed at exit.
                cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
                cert.write_bytes(tls[0])
                key.touch(mode=0o600)
                key.write_bytes(tls[1])
                ssl = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
            config = uvicorn.Config(
                app, log_level="warning" if args.quiet else "info", access_log=not args.quiet,
                lifespan="off", timeout_graceful_shutdown=5, http=_http_protocol(args),
                # X-Forwarded-For only changes the client address the access log shows.
                proxy_headers=not args.quiet, **ssl,
            )  # fmt: skip
            server = uvicorn.Server(config)
            if args.grpc_port:
                # lazy: grpc, imported once the models loaded
                from neuropod_serving.server.grpc_server import start_grpc_server

                # Taken while the models loaded? Say so in our words, not in grpcio's log.
                _bind(args.host, args.grpc_port, "--grpc-port", reuse_port=shared).close()
                try:
                    grpc_server, _ = start_grpc_server(
                        engine, f"{show_host(args.host)}:{args.grpc_port}", auth_token=token, tls=tls,
                        max_message_bytes=args.max_request_bytes, access_log=not args.quiet,
                        max_streams=getattr(args, "max_grpc_streams", DEFAULT_MAX_GRPC_STREAMS), reuse_port=shared,
                    )  # fmt: skip
                except NeuropodError as e:
                    raise _port_error(args.host, args.grpc_port, "--grpc-port", str(e)) from None
            try:
                if not args.quiet and group is None:  # the parent of --processes says it for the group
                    print(serving_line(args, len(engine.registry.names()), token, tls), file=out, flush=True)
                started = None
                if group is not None:
                    started = asyncio.get_running_loop().create_task(
                        _when_started(server, group, on_serving, len(engine.registry.names()))
                    )
                await server.serve(sockets=sockets)
                if started is not None:
                    started.cancel()
            finally:
                if grpc_server is not None:
                    await asyncio.to_thread(grpc_server.stop, 2)

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    finally:
        for sock in sockets:
            sock.close()


async def _when_started(server: Any, group: Any, on_serving: Any, models: int) -> None:
    """Once uvicorn accepts connections, tell the parent of --processes this process is up."""
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.01)
    if on_serving is not None:
        on_serving()
    group.up(models)


def _http_protocol(args: argparse.Namespace) -> Any:
    """uvicorn's httptools protocol sending each response in one write and bounding request
    heads by ``args``, else uvicorn's choice."""
    try:
        # lazy: httptools and uvicorn (optional: without httptools uvicorn uses h11)
        from neuropod_serving.server.http import OneWriteProtocol
    except ImportError:  # no httptools: uvicorn falls back to h11
        return "auto"
    return OneWriteProtocol.with_limits(
        max_head_bytes=args.max_head_bytes, max_headers=args.max_headers, head_timeout_s=args.head_timeout
    )


def show_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


#: What each port flag serves, and how to do without it, for the message when it cannot be bound.
_PORT_FLAGS = {
    "--http-port": ("REST", ""),
    "--grpc-port": ("gRPC", " (0 turns gRPC off)"),
    "--metrics-port": ("metrics", " (0 turns it off; /metrics stays on the REST port)"),
}


def _port_error(host: str, port: int, flag: str, error: OSError | str) -> NeuropodError:
    """One line naming the port, what it was for, and the flag that changes it."""
    what, off = _PORT_FLAGS[flag]
    where = f"{show_host(host)}:{port}"
    if isinstance(error, str):  # grpcio's words, which do not say why
        return NeuropodError(
            f"{flag} {port}: cannot listen on {where} for {what} ({error}); if another server took the port, "
            f"choose a free one with {flag} PORT{off}"
        )
    reason = error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        return NeuropodError(
            f"{flag} {port}: the {what} port {where} is already in use (by another server?); stop that server, "
            f"or choose a free port with {flag} PORT{off}"
        )
    if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        return NeuropodError(
            f"--host {host}: cannot listen on {where} ({reason}); give a name or address of this machine, "
            "e.g. 127.0.0.1, or 0.0.0.0 for all"
        )
    if error.errno == errno.EACCES:
        return NeuropodError(
            f"{flag} {port}: not allowed to listen on {where} for {what} ({reason}; ports below 1024 need "
            f"privileges); choose another with {flag} PORT{off}"
        )
    return NeuropodError(f"{flag} {port}: cannot listen on {where} for {what} ({reason})")


def _bind(host: str, port: int, flag: str, *, reuse_port: bool = False) -> Any:
    """A listening socket on host:port, bound now so a port in use fails the start with its flag named.

    With ``reuse_port`` (SO_REUSEPORT), the other processes of ``--processes`` listen on it too.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _port_error(host, port, flag, e) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_ports(args: argparse.Namespace) -> None:
    """Fail now, before the models load (which can take minutes), if a port is taken.

    Each port is bound and let go again; the server binds it for good once the models are loaded.
    gRPC's own bind failure would also print a line of grpcio's C core log, which this avoids.
    """
    for flag, port in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port),
                       ("--metrics-port", args.metrics_port)):  # fmt: skip
        if port:
            _bind(args.host, port, flag).close()
