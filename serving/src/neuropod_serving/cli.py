"""``neuropod serve PATH...``: serve packages over the Open Inference Protocol (REST and gRPC).

The core's ``neuropod`` command finds this module through the
``neuropod.commands`` entry point and calls :func:`add_arguments` and
:func:`run`. Importing it imports no server library and no framework, so
``neuropod --help`` stays fast; :func:`run` imports them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from neuropod.errors import NeuropodError

log = logging.getLogger("neuropod_serving.cli")
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20
#: The request line and headers of one REST request, in bytes (then 431).
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
#: Headers in one REST request (then 431).
DEFAULT_MAX_HEADERS = 100
#: Seconds a REST request head may take from its first byte (or from the connection) to its end (then 408).
DEFAULT_HEAD_TIMEOUT_S = 15.0
# neuropod_serving.server.engine's defaults, repeated so that `neuropod --help` imports no numpy
# (test_busy_models checks that they agree).
DEFAULT_MAX_CONCURRENT = 4
DEFAULT_MAX_QUEUED = 64
# neuropod_serving.server.grpc_repository's (test_grpc_streams checks that they agree).
DEFAULT_MAX_GRPC_STREAMS = 64


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _processes(text: str) -> int:
    if text.strip() == "auto":
        from neuropod_serving.server.processes import usable_cpus

        return usable_cpus()
    return _positive(text)


def _non_negative(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _positive(text)


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {value}")
    return value


def _port_or_off(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _port(text)


def _delay_us(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of microseconds") from None
    if not 0 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"must be 0 to 10,000,000 microseconds (10 s), not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``neuropod serve``."""
    parser.add_argument(
        "paths", nargs="+", metavar="PATH",
        help="a package (directory or zip), or a model repository: a folder of packages, or of model folders "
        "holding numbered versions (MODEL/1/, MODEL/2/); a local path or a URL (s3://, gs://, az://, abfs://)",
    )  # fmt: skip
    parser.add_argument("--http-port", type=_port, default=8000, help="REST port (default 8000)")
    parser.add_argument("--grpc-port", type=_port_or_off, default=8001, help="gRPC port (default 8001; 0: no gRPC)")
    parser.add_argument(
        "--metrics-port", type=_port_or_off, default=8002,
        help="port answering only GET /metrics (default 8002; 0: none; /metrics is on the REST port too)",
    )  # fmt: skip
    parser.add_argument(
        "--version-policy", type=_version_policy, default=None, metavar="POLICY",
        help="which versions of each model to serve: 'latest' (the default), 'latest:N', 'all', or "
        "'specific:V,V' (versions are MODEL/<number>/ folders; a package standing alone is version 1)",
    )  # fmt: skip
    parser.add_argument(
        "--poll-interval", type=_seconds, default=None, metavar="S",
        help="look at the repository every S seconds: load new models and versions (and changed ones), "
        "unload removed ones once their requests finish; a version that fails to load is reported and "
        "replaces nothing. Repository load and unload requests are then refused (default: no polling)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument(
        "--processes", type=_processes, default=1, metavar="N",
        help="serve from N server processes sharing the ports (Linux: SO_REUSEPORT), each with its own copy "
        "of every model, so request handling uses N cores; 'auto': one per usable CPU (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=_positive, default=1,
        help="above 1, run each model in N out-of-process workers so CPU-bound models are not held to one GIL; "
        "each run then costs a round trip to a worker (0.1 to 1 ms), more than a quick model's whole run: "
        "to handle more requests, use --processes",
    )  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=_positive, default=1, metavar="B",
        help="above 1, batch requests to models whose spec has a batch dimension, up to B rows per run",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue-delay-us", type=_delay_us, default=0, metavar="D",
        help="with --max-batch-size: wait up to D microseconds after the oldest request for more "
        "to join its batch (default 0: batch what is waiting)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-runs", type=_positive, default=None, metavar="N",
        help=f"runs of one model at once; each model has its own (default {DEFAULT_MAX_CONCURRENT}, "
        "or 2 per --workers when that is more)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queued-requests", type=_non_negative, default=DEFAULT_MAX_QUEUED, metavar="N",
        help="requests of one model that may wait for a run or a batch; more are refused at once with "
        f"429 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_QUEUED})",
    )  # fmt: skip
    parser.add_argument(
        "--max-grpc-streams", type=_positive, default=DEFAULT_MAX_GRPC_STREAMS, metavar="N",
        help="gRPC ModelStreamInfer and health Watch streams open at once; one more is refused with "
        f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_GRPC_STREAMS})",
    )  # fmt: skip
    parser.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'Authorization: Bearer <token>' (the file's first line) on every route except health "
        "(gRPC: the same in 'authorization' metadata)",
    )  # fmt: skip
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve REST, gRPC and metrics over TLS with this certificate (chain)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="B",
        help=f"refuse larger request bodies with 413 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_REQUEST_BYTES:,})",
    )  # fmt: skip
    parser.add_argument(
        "--max-head-bytes", type=_positive, default=DEFAULT_MAX_HEAD_BYTES, metavar="B",
        help=f"refuse REST requests whose request line and headers pass B bytes with 431 (default {DEFAULT_MAX_HEAD_BYTES:,})",
    )  # fmt: skip
    parser.add_argument(
        "--max-headers", type=_positive, default=DEFAULT_MAX_HEADERS, metavar="N",
        help=f"refuse REST requests with more than N headers with 431 (default {DEFAULT_MAX_HEADERS})",
    )  # fmt: skip
    parser.add_argument(
        "--head-timeout", type=_seconds, default=DEFAULT_HEAD_TIMEOUT_S, metavar="S",
        help="close REST connections whose request head is not complete S seconds after it began, "
        f"with 408 (default {DEFAULT_HEAD_TIMEOUT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--allow-client-shm", action="store_true",
        help="let clients on this machine register system (POSIX) and CUDA shared memory regions and pass "
        "tensors in them (Triton's shared-memory extensions; off by default: a client could then make the "
        "server read and write any shared memory object this user can open)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no start-up table and no access log (warnings and errors only)")
    ray = parser.add_argument_group(
        "Ray Serve", "deploy each package as a Ray Serve application (pip install 'neuropod-serving[ray]')"
    )
    ray.add_argument(
        "--ray", action="store_true",
        help="serve through Ray Serve: replicas across the cluster, its HTTP and gRPC proxies on "
        "--http-port and --grpc-port; metrics through Ray's metrics agents",
    )  # fmt: skip
    ray.add_argument(
        "--address", metavar="ADDR",
        help="with --ray: the cluster to join (ray://host:10001, host:6379 or auto; default: start a local one)",
    )  # fmt: skip
    ray.add_argument("--replicas", type=_positive, default=1, metavar="N", help="with --ray: replicas per model (default 1)")
    ray.add_argument(
        "--num-cpus", type=float, metavar="C",
        help="with --ray: CPUs each replica reserves (default: --workers); fractions let small models share a core",
    )  # fmt: skip


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
    import ssl

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
    from neuropod_serving.server import MODEL_VERSION, Engine, ModelRegistry

    assert isinstance(registry, ModelRegistry)
    versioned = any(s.version != MODEL_VERSION for s in registry)
    rows = [("MODEL", "PLATFORM", "BACKEND", "DEVICE", "BATCHED", "INPUTS")]
    for served in sorted(registry, key=lambda s: (s.name, int(s.version))):
        m = served.model
        inputs = ", ".join(f"{s.name}: {s.dtype}{list(s.shape)}".replace("'", "") for s in m.inputs)
        if isinstance(engine, Engine):
            on, why = engine.batched(served.name, served.version)
            batched = "yes" if on else f"no ({why})"
        else:
            batched = "no"
        name = f"{served.name} (version {served.version})" if versioned else served.name
        rows.append((name, m.platform, m.backend.id, m.device, batched, inputs))
    n = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:n], widths)), r[n]]).rstrip() for r in rows)


#: Modules `neuropod serve` imports, from the [server] extra.
SERVER_MODULES = (
    "starlette", "uvicorn", "httptools", "grpc", "grpc_health", "google.protobuf", "prometheus_client", "orjson",
)  # fmt: skip


def _check_server_libraries() -> None:
    import importlib.util

    missing = []
    for module in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing (google)
            found = False
        if not found:
            missing.append(module)
    if missing:
        from neuropod.errors import PluginNotInstalledError
        from neuropod.plugins import pip_install

        install = pip_install("'neuropod-serving[server]'")
        raise PluginNotInstalledError(
            f"`neuropod serve` needs the server's libraries ({', '.join(missing)} not installed): {install}"
        )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load every package, print the table, and serve until interrupted."""
    out = out or sys.stdout
    processes = getattr(args, "processes", 1)
    if processes > 1:
        from neuropod_serving.server.processes import check_options

        check_options(args, processes)
    if getattr(args, "ray", False):
        return run_ray(args, out)
    if getattr(args, "address", None) is not None:
        raise NeuropodError("--address is an option of --ray")
    if getattr(args, "replicas", 1) != 1 or getattr(args, "num_cpus", None) is not None:
        raise NeuropodError("--replicas and --num-cpus are options of --ray")
    _check_server_libraries()
    token = read_token(args.auth_token_file) if args.auth_token_file is not None else None
    tls = read_tls(args.tls_cert, args.tls_key)
    ports = [p for p in (args.http_port, args.grpc_port, args.metrics_port) if p]
    if len(set(ports)) != len(ports):
        raise NeuropodError(
            f"--http-port {args.http_port}, --grpc-port {args.grpc_port} and --metrics-port {args.metrics_port} "
            "must differ (0 turns gRPC or the metrics port off)"
        )
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    # Models load before the ports open: a bad package fails the start, not the first request.
    # A port taken by another server fails it before they load.
    _check_ports(args)
    if processes > 1:
        from neuropod.storage import is_package_url
        from neuropod_serving.server.processes import run_group
        from neuropod_serving.server.versions import scan_local

        for path in args.paths:  # a PATH without packages fails now, not N times
            if not is_package_url(path):
                scan_local(path)

        def line(models: int, count: int) -> str:
            return _serving_line(args, models, token, tls, processes=count)

        return run_group(args, processes, out, None if args.quiet else line)
    serve_models(args, token, tls, out)
    return 0


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
    or one process of ``--processes`` (``group``, a :class:`~.server.processes.GroupMember`).

    :param on_serving: called once the ports are open and requests are served.
    :param table: print the start-up table (unless ``--quiet``).
    """
    from neuropod_serving.server import BatchPolicy, Engine, ModelLimits, ModelRegistry
    from neuropod_serving.server.metrics import ServerMetrics, WorkerRunWatch

    registry = ModelRegistry.load(args.paths, workers=args.workers, policy=getattr(args, "version_policy", None))
    batching = BatchPolicy(args.max_batch_size, args.max_queue_delay_us / 1e6) if args.max_batch_size > 1 else None
    limits = ModelLimits(args.max_concurrent_runs, args.max_queued_requests)
    shared_memory = None
    if getattr(args, "allow_client_shm", False):
        from neuropod_serving.server.shared_memory import SharedMemoryRegistry

        shared_memory = SharedMemoryRegistry()
    metrics = ServerMetrics()
    engine = Engine(registry, batching=batching, metrics=metrics, limits=limits, shared_memory=shared_memory)
    if args.workers > 1 and not (group is not None and group.index != 0):  # one process of a group says it

        def run_time(name: str) -> tuple[int, float] | None:
            measured = getattr(engine.get(name).model, "worker_run_time", None)
            return measured if isinstance(measured, tuple) else None

        metrics.watch = WorkerRunWatch(run_time, args.workers)
    if group is not None:
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


def run_ray(args: argparse.Namespace, out: TextIO) -> int:
    """``neuropod serve --ray``: each package becomes a Ray Serve application named after its model,
    on the cluster at ``--address`` (or a local one); Ctrl-C deletes them again."""
    if getattr(args, "allow_client_shm", False):
        raise NeuropodError(
            "--allow-client-shm is not supported with --ray: Ray Serve's replicas may run on other machines "
            "than the client's shared memory"
        )
    if args.tls_cert is not None or args.tls_key is not None:
        raise NeuropodError(
            "--tls-cert/--tls-key are not supported with --ray: Ray Serve's proxies serve plain HTTP and gRPC "
            "(terminate TLS in front of them)"
        )
    if args.metrics_port not in (0, 8002):
        raise NeuropodError(
            "--metrics-port does not apply with --ray: each node's Ray metrics agent exports the replicas' metrics"
        )
    try:
        import ray
        from ray import serve

        from neuropod_serving import ray as neuropod_ray
    except ImportError as e:
        from neuropod.errors import PluginNotInstalledError
        from neuropod.plugins import pip_install

        install = pip_install("'neuropod-serving[ray]'")
        raise PluginNotInstalledError(
            f"`neuropod serve --ray` needs Ray Serve ({e.name} is not installed): {install}"
        ) from None
    from neuropod_serving.server import find_packages

    if getattr(args, "poll_interval", None) is not None or getattr(args, "version_policy", None) is not None:
        raise NeuropodError("--poll-interval and --version-policy are not options of --ray: it serves the packages "
                            "of its PATHs, one version each")  # fmt: skip
    token = read_token(args.auth_token_file) if args.auth_token_file is not None else None
    packages = [pkg for path in args.paths for pkg in find_packages(path)]
    ray.init(address=args.address, logging_level=logging.WARNING if args.quiet else logging.INFO)
    names: list[str] = []
    try:
        neuropod_ray.start(http_host=args.host, http_port=args.http_port, grpc_port=args.grpc_port)
        refs = [neuropod_ray.publish(pkg) for pkg in packages]
        seen: dict[str, str] = {}
        for ref in refs:
            if ref.name in seen:
                raise NeuropodError(
                    f"two packages are both named {ref.name!r}: {seen[ref.name]} and {ref.source}; "
                    "a server answers to one model per name"
                )
            seen[ref.name] = ref.source
        for i, ref in enumerate(refs):
            application = neuropod_ray.build(
                ref, num_replicas=args.replicas, workers=args.workers, max_batch_size=args.max_batch_size,
                max_queue_delay_us=args.max_queue_delay_us, auth_token=token, max_request_bytes=args.max_request_bytes,
                ray_actor_options=None if args.num_cpus is None else {"num_cpus": args.num_cpus},
            )  # fmt: skip
            # The first model answers the server-wide routes (/v2, health); the others their own paths.
            prefix = "/" if i == 0 else f"/v2/models/{ref.name}"
            serve.run(application, name=ref.name, route_prefix=prefix, blocking=False)
            names.append(ref.name)
        if not args.quiet:
            host = _show_host(args.host)
            where = [f"REST http://{host}:{args.http_port}/v2"]
            if args.grpc_port:
                where.append(f"gRPC {host}:{args.grpc_port}")
            print(
                f"serving {len(names)} model(s) on Ray Serve ({args.replicas} replica(s) each): {', '.join(where)}; "
                f"models: {', '.join(names)}; metrics: each node's Ray metrics agent (ray_neuropod_*)",
                file=out, flush=True,
            )  # fmt: skip
        _wait_for_ctrl_c()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        _leave_ray(serve, ray, names)


def _wait_for_ctrl_c() -> None:
    """Return on SIGINT or SIGTERM. The handler is this command's own, put back every second
    if something replaced it: Ray's client swaps SIGINT's handler while it works (deferring the
    signal), and a Ctrl-C that met a handler left behind did nothing (the command then ran
    until killed)."""
    import signal
    import threading

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not stop.wait(1.0):
        if signal.getsignal(signal.SIGINT) is not on_signal:
            signal.signal(signal.SIGINT, on_signal)


#: Seconds Ctrl-C waits for Ray Serve to delete the applications, then for Ray to disconnect.
RAY_STOP_S = 45.0


def _leave_ray(serve: Any, ray: Any, names: list[str], timeout_s: float = RAY_STOP_S) -> None:
    """Delete this command's applications and disconnect from Ray (stopping the local cluster
    ``ray.init`` started), each step within ``timeout_s``. Ctrl-C in a terminal interrupts the
    whole process group, the local cluster's own processes too, and a delete can then wait on
    a controller that is going away: past the bound the command says what it left and exits
    rather than hang (its threads in Ray's client would keep the process alive)."""
    import os
    import threading
    import time

    def delete() -> None:
        for name in names:
            try:
                serve.delete(name)
            except Exception:  # the cluster may be gone already
                log.debug("could not delete application %r", name, exc_info=True)

    for what, step in (("deleting the applications", delete), ("disconnecting from Ray", ray.shutdown)):
        started = time.monotonic()
        worker = threading.Thread(target=step, name=f"neuropod-ray-stop-{step.__name__}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning(
                "Ray did not finish %s in %g s; exiting without it (on a cluster of its own, check with "
                "`serve status` that the applications %s are gone)", what, timeout_s, ", ".join(names) or "(none)",
            )  # fmt: skip
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        log.info("%s took %.1f s", what, time.monotonic() - started)


#: How long a thread may keep the GIL while another waits (Python's default is 5 ms).
#: A server's threads hold it in short bursts, and a model run lets it go: with
#: the default, a gRPC thread whose run has just finished can wait milliseconds
#: to get it back. Measured on the tiny model, gRPC at concurrency 8, one core:
#: about 2,100 requests/s at 5 ms, 2,400 at 1 ms, 2,500 at 0.2 ms, 2,600 at 0.05 ms.
GIL_SWITCH_S = 0.0001


def _serving_line(
    args: argparse.Namespace, models: int, token: str | None, tls: tuple[bytes, bytes] | None, *, processes: int = 1
) -> str:
    """Where the server listens, the line printed once it does."""
    scheme = "https" if tls else "http"
    auth = "bearer token required" if token else "no authentication"
    where = [f"REST {scheme}://{_show_host(args.host)}:{args.http_port}/v2"]
    if args.grpc_port:
        where.append(f"gRPC {_show_host(args.host)}:{args.grpc_port}{' (TLS)' if tls else ''}")
    if args.metrics_port:
        where.append(f"metrics {scheme}://{_show_host(args.host)}:{args.metrics_port}/metrics")
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
    import asyncio
    import tempfile

    import uvicorn

    from neuropod_serving.server import create_app
    from neuropod_serving.server.app import metrics_only

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
                from neuropod_serving.server.grpc_service import start_grpc_server

                # Taken while the models loaded? Say so in our words, not in grpcio's log.
                _bind(args.host, args.grpc_port, "--grpc-port", reuse_port=shared).close()
                try:
                    grpc_server, _ = start_grpc_server(
                        engine, f"{_show_host(args.host)}:{args.grpc_port}", auth_token=token, tls=tls,
                        max_message_bytes=args.max_request_bytes, access_log=not args.quiet,
                        max_streams=getattr(args, "max_grpc_streams", DEFAULT_MAX_GRPC_STREAMS), reuse_port=shared,
                    )  # fmt: skip
                except NeuropodError as e:
                    raise _port_error(args.host, args.grpc_port, "--grpc-port", str(e)) from None
            try:
                if not args.quiet and group is None:  # the parent of --processes says it for the group
                    print(_serving_line(args, len(engine.registry.names()), token, tls), file=out, flush=True)
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
    import asyncio

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
        from neuropod_serving.server.http import OneWriteProtocol
    except ImportError:  # no httptools: uvicorn falls back to h11
        return "auto"
    return OneWriteProtocol.with_limits(
        max_head_bytes=args.max_head_bytes, max_headers=args.max_headers, head_timeout_s=args.head_timeout
    )


def _version_policy(text: str) -> Any:
    from neuropod_serving.server.versions import VersionPolicy

    try:
        return VersionPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds above 0, not {text!r}")
    return value


def _show_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


#: What each port flag serves, and how to do without it, for the message when it cannot be bound.
_PORT_FLAGS = {
    "--http-port": ("REST", ""),
    "--grpc-port": ("gRPC", " (0 turns gRPC off)"),
    "--metrics-port": ("metrics", " (0 turns it off; /metrics stays on the REST port)"),
}


def _port_error(host: str, port: int, flag: str, error: OSError | str) -> NeuropodError:
    """One line naming the port, what it was for, and the flag that changes it."""
    import errno
    import socket

    what, off = _PORT_FLAGS[flag]
    where = f"{_show_host(host)}:{port}"
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
    import socket

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


def _check_ports(args: argparse.Namespace) -> None:
    """Fail now, before the models load (which can take minutes), if a port is taken.

    Each port is bound and let go again; the server binds it for good once the models are loaded.
    gRPC's own bind failure would also print a line of grpcio's C core log, which this avoids.
    """
    for flag, port in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port),
                       ("--metrics-port", args.metrics_port)):  # fmt: skip
        if port:
            _bind(args.host, port, flag).close()
