"""What ``neuropod serve`` runs once its options are parsed: one server process
(:mod:`neuropod_serving.server.launcher`), a group of them (``--processes``,
:mod:`neuropod_serving.processes`), or the packages deployed on Ray Serve (``--ray``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from neuropod.errors import NeuropodError, PluginNotInstalledError
from neuropod.plugins import pip_install
from neuropod.storage import is_package_url
from neuropod_serving.defaults import DEFAULT_MAX_SEQUENCE_IDLE_US, DEFAULT_MAX_SEQUENCES
from neuropod_serving.processes import check_options, run_group
from neuropod_serving.server import find_packages
from neuropod_serving.server.launcher import (
    check_ports,
    check_server_libraries,
    read_tls,
    read_token,
    serve_models,
    serving_line,
    show_host,
)
from neuropod_serving.server.served_versions import scan_local

log = logging.getLogger("neuropod_serving.cli")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load every package, print the table, and serve until interrupted."""
    out = out or sys.stdout
    processes = getattr(args, "processes", 1)
    if processes > 1:
        check_options(args, processes)
    if getattr(args, "ray", False):
        return run_ray(args, out)
    if getattr(args, "address", None) is not None:
        raise NeuropodError("--address is an option of --ray")
    if getattr(args, "replicas", 1) != 1 or getattr(args, "num_cpus", None) is not None:
        raise NeuropodError("--replicas and --num-cpus are options of --ray")
    check_server_libraries()
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
    check_ports(args)
    if processes > 1:
        for path in args.paths:  # a PATH without packages fails now, not N times
            if not is_package_url(path):
                scan_local(path)

        def line(models: int, count: int) -> str:
            return serving_line(args, models, token, tls, processes=count)

        return run_group(args, processes, out, None if args.quiet else line)
    serve_models(args, token, tls, out)
    return 0


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

        from neuropod_serving import ray as neuropod_ray  # lazy: ray, the optional [ray] extra
    except ImportError as e:
        install = pip_install("'neuropod-serving[ray]'")
        raise PluginNotInstalledError(
            f"`neuropod serve --ray` needs Ray Serve ({e.name} is not installed): {install}"
        ) from None
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
                max_sequence_idle_us=_sequence_limits(args)[0], max_sequences=_sequence_limits(args)[1],
            )  # fmt: skip
            # The first model answers the server-wide routes (/v2, health); the others their own paths.
            prefix = "/" if i == 0 else f"/v2/models/{ref.name}"
            serve.run(application, name=ref.name, route_prefix=prefix, blocking=False)
            names.append(ref.name)
        if not args.quiet:
            host = show_host(args.host)
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


def _sequence_limits(args: Any) -> tuple[int, int]:
    """``--max-sequence-idle-us`` and ``--max-sequences`` (their defaults when not parsed)."""
    idle = getattr(args, "max_sequence_idle_us", None)
    live = getattr(args, "max_sequences", None)
    return (DEFAULT_MAX_SEQUENCE_IDLE_US if idle is None else int(idle), DEFAULT_MAX_SEQUENCES if live is None else int(live))


def _wait_for_ctrl_c() -> None:
    """Return on SIGINT or SIGTERM. The handler is this command's own, put back every second
    if something replaced it: Ray's client swaps SIGINT's handler while it works (deferring the
    signal), and a Ctrl-C that met a handler left behind did nothing (the command then ran
    until killed)."""
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
