"""``neuropod serve --processes N``: N server processes sharing the REST, gRPC and metrics ports.

One Python process handles requests on one core at a time (the GIL), however
many threads it has. With ``--processes N`` the command becomes a parent that
starts N server processes (``multiprocessing``'s spawn: fresh interpreters,
nothing inherited but the options) and serves nothing itself:

- Each process loads every model itself (N copies in memory) and binds its own
  listening sockets with ``SO_REUSEPORT`` (gRPC: grpcio's ``grpc.so_reuseport``),
  so Linux spreads new connections over them. A connection stays with the
  process that accepted it.
- The parent holds one control connection (a ``multiprocessing`` pipe) to each.
  A repository load or unload received by any process is sent to the parent,
  which applies it in every process, one operation at a time, and answers once
  all have (the first failure, if any, is the answer). ``GET /metrics``
  (on the REST port and on ``--metrics-port``) asks the parent, which collects
  every process's metrics and sums them: counters and histograms add up,
  ``neuropod_models_loaded`` is the smallest count, and
  ``neuropod_server_processes`` says how many processes answered.
- ``/v2/health/ready`` and ServerReady say ready only once every process is
  listening, and not ready again once one has stopped or the group is stopping.
- SIGINT or SIGTERM to the parent stops every process (each drains as the
  single-process server does) and the parent exits 0. A process that dies on
  its own stops the group: the parent stops the others and exits 1, for the
  supervisor (systemd, Kubernetes) to restart it whole; restarting one process
  alone would have to replay every repository operation since the start.
  A process whose parent disappears (killed) stops itself.

What stays per process: Triton's statistics (``/v2/models/stats``) count the
requests of the process that answers, and shared-memory registrations could
not follow a client to another process, so ``--allow-client-shm`` is refused.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TextIO

from neuropod.errors import NeuropodError
from neuropod_serving.server import repository_api
from neuropod_serving.server.launcher import read_tls, read_token, serve_models

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from neuropod_serving.server.engine import Engine

log = logging.getLogger("neuropod_serving.server")

#: Seconds a ``/metrics`` scrape waits for every process's metrics.
METRICS_TIMEOUT_S = 5.0
#: Seconds the parent gives its processes to stop after SIGTERM before it kills them
#: (each gives requests 5 s and gRPC calls 2 s, then closes its models).
STOP_S = 15.0


class _Channel:
    """One end of a control connection: sends under a lock, and matches answers to questions by id.

    Messages are tuples: ``("ask", id, what, payload)`` a question, ``("reply", id, ok, value)``
    its answer (``value`` an exception when not ``ok``), anything else a notice.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._gone: BaseException | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def ask(self, what: str, payload: Any = None) -> Future[Any]:
        """Send a question; its answer resolves the returned future (or the other side's end fails it)."""
        future: Future[Any] = Future()
        ident = next(self._ids)
        self._pending[ident] = future  # before looking at _gone: ended() fails it, or it sees _gone
        if self._gone is not None:
            self._pending.pop(ident, None)
            future.set_exception(self._gone)
            return future
        try:
            self.send(("ask", ident, what, payload))
        except OSError as e:
            self._pending.pop(ident, None)
            future.set_exception(NeuropodError(f"the control connection is closed ({e})"))
        future.add_done_callback(lambda _: self._pending.pop(ident, None))
        return future

    def reply(self, ident: int, ok: bool, value: Any) -> None:
        try:
            self.send(("reply", ident, ok, value))
        except OSError:
            pass  # the asker is gone: nobody waits for the answer

    def answered(self, ident: int, ok: bool, value: Any) -> None:
        future = self._pending.get(ident)
        if future is not None and not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def ended(self, error: BaseException) -> None:
        """The other side is gone: fail every question waiting for it, and the ones asked from now on."""
        self._gone = error
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (it crosses to another process as itself), else a NeuropodError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))  # noqa: S301  # our own bytes, made on the line
    except Exception:  # noqa: BLE001  # an exception class with a constructor of its own
        return NeuropodError(str(exc))
    return exc


# -- a server process ----------------------------------------------------------------------------------


class GroupMember:
    """A server process's side of the group: what :class:`~neuropod_serving.server.engine.Engine`'s
    ``group`` holds, asked by the front ends for repository operations, metrics and readiness."""

    def __init__(self, conn: Connection, index: int) -> None:
        self.index = index
        #: Whether every process of the group is listening (set by the parent).
        self.ready = False
        self._channel = _Channel(conn)
        self._engine: Engine | None = None
        self._stopping = False
        threading.Thread(target=self._read, name="neuropod-group", daemon=True).start()

    def attach(self, engine: Engine) -> None:
        """Serve the parent's requests (repository operations, metrics) from ``engine``."""
        self._engine = engine

    def up(self, models: int) -> None:
        """Tell the parent this process listens on every port."""
        try:
            self._channel.send(("up", os.getpid(), models))
        except OSError:
            pass  # the parent is gone: the reader thread stops this process

    def failed(self, message: str) -> None:
        """Tell the parent why this process could not start."""
        try:
            self._channel.send(("failed", message))
        except OSError:
            pass

    def stopping(self) -> None:
        """This process is stopping: not ready, and the parent's going away is expected."""
        self._stopping = True
        self.ready = False

    def repository(self, op: str, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Apply a repository ``op`` ("load" or "unload") in every process of the group; blocks.

        :raises NeuropodError: what :mod:`~neuropod_serving.server.repository_api` raises in the
            first process where it failed.
        """
        self._channel.ask("repository", (op, name, parameters)).result()

    def metrics(self) -> bytes:
        """The Prometheus text of the whole group's metrics; blocks.

        :raises NeuropodError: a process did not answer within :data:`METRICS_TIMEOUT_S`.
        """
        try:
            result: bytes = self._channel.ask("metrics").result(METRICS_TIMEOUT_S * 2)
        except FutureTimeout:
            raise NeuropodError(f"the parent process did not answer within {METRICS_TIMEOUT_S * 2:g} s") from None
        return result

    def _read(self) -> None:
        conn = self._channel.conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "reply":
                self._channel.answered(*message[1:])
            elif kind == "ask":
                self._answer(*message[1:])
            elif kind == "ready":
                self.ready = bool(message[1])
        self.ready = False
        self._channel.ended(NeuropodError("the parent process of this server is gone"))
        if not self._stopping:
            log.error("the parent process (neuropod serve --processes) is gone; this server process stops")
            os.kill(os.getpid(), signal.SIGTERM)

    def _answer(self, ident: int, what: str, payload: Any) -> None:
        if what == "metrics":  # quick, under the metrics' lock: answered on this thread
            engine = self._engine
            families = engine.metrics.families() if engine is not None else []  # type: ignore[attr-defined]
            self._channel.reply(ident, True, families)
        elif what == "apply":  # a load can take minutes: on a thread of its own
            threading.Thread(
                target=self._apply, args=(ident, *payload), name="neuropod-group-apply", daemon=True
            ).start()
        else:
            self._channel.reply(ident, False, NeuropodError(f"unknown group request {what!r}"))

    def _apply(self, ident: int, op: str, name: str, parameters: dict[str, Any] | None) -> None:
        engine = self._engine
        try:
            if engine is None:
                raise NeuropodError(f"server process {self.index} is still loading its models")
            if op == "load":
                repository_api.load_here(engine, name, parameters or {})
            else:
                repository_api.unload_here(engine, name)
        except Exception as e:  # noqa: BLE001  # every failure is the answer, sent back to the asker
            self._channel.reply(ident, False, _sendable(e))
        else:
            self._channel.reply(ident, True, None)


def _child_main(options: dict[str, Any], index: int, conn: Connection) -> None:
    """A server process: load the models, listen with SO_REUSEPORT, serve until SIGTERM."""
    member = GroupMember(conn, index)
    serving = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        # While serving, uvicorn has its own handler and re-raises the signal after it stopped:
        # then there is nothing left to do here. Before (loading models), stop now.
        member.stopping()
        if not serving.is_set():
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    # The parent turns a Ctrl-C (which the terminal sends the whole process group) into SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = argparse.Namespace(**options)
    if not args.quiet:  # a fresh interpreter: the parent's logging set-up, again
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        token = read_token(args.auth_token_file) if args.auth_token_file is not None else None
        tls = read_tls(args.tls_cert, args.tls_key)
        serve_models(args, token, tls, sys.stdout, group=member, on_serving=serving.set, table=index == 0)
    except NeuropodError as e:
        member.failed(str(e))
        sys.exit(2)
    except (SystemExit, KeyboardInterrupt):
        pass
    except BaseException as e:
        member.failed(f"unexpected {type(e).__name__} in server process {index}: {e}")
        raise
    finally:
        # Leaving: a SIGTERM from now on (the parent stopping the group because another process
        # failed) must not raise SystemExit again inside the interpreter's exit handlers.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        member.stopping()


# -- the parent --------------------------------------------------------------------------------------


class _Child:
    def __init__(self, index: int, process: Any, conn: Connection) -> None:
        self.index = index
        self.process = process
        self.channel = _Channel(conn)
        self.up = False
        self.models = 0
        self.reader: threading.Thread | None = None


class _Group:
    """The parent: starts the processes, routes their questions, stops them all."""

    def __init__(self, args: argparse.Namespace, processes: int) -> None:
        self.args = args
        self.count = processes
        self.children: list[_Child] = []
        self.failure: str | None = None
        self.all_up = threading.Event()
        self.changed = threading.Event()  # something the main loop must look at
        self.stopping = False
        self._repository_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="neuropod-group")

    def start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        options = {k: v for k, v in vars(self.args).items() if k != "func"}
        for index in range(self.count):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_child_main, args=(options, index, child_end), name=f"neuropod-serve-{index}", daemon=False
            )
            process.start()
            child_end.close()
            child = _Child(index, process, parent_end)
            child.reader = threading.Thread(
                target=self._read, args=(child,), name=f"neuropod-group-{index}", daemon=True
            )
            child.reader.start()
            self.children.append(child)

    def _read(self, child: _Child) -> None:
        while True:
            try:
                message = child.channel.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "reply":
                child.channel.answered(*message[1:])
            elif kind == "ask":
                self._pool.submit(self._answer, child, *message[1:])
            elif kind == "up":
                child.up, child.models = True, message[2]
                if all(c.up for c in self.children) and len(self.children) == self.count:
                    self.all_up.set()
                self.changed.set()
            elif kind == "failed":
                self.failure = self.failure or message[1]
                self.changed.set()
        child.channel.ended(
            NeuropodError(f"server process {child.index} (pid {child.process.pid}) stopped before it answered")
        )
        self.changed.set()

    def _answer(self, child: _Child, ident: int, what: str, payload: Any) -> None:
        try:
            value: Any = None
            if what == "repository":
                self._repository(*payload)
            elif what == "metrics":
                value = self._metrics()
            else:
                raise NeuropodError(f"unknown group request {what!r}")
        except Exception as e:  # noqa: BLE001  # the asker raises it
            child.channel.reply(ident, False, _sendable(e))
        else:
            child.channel.reply(ident, True, value)

    def _repository(self, op: str, name: str, parameters: dict[str, Any] | None) -> None:
        self.all_up.wait()
        # One operation at a time: every process sees loads and unloads in the same order.
        with self._repository_lock:
            if self.stopping:
                raise NeuropodError(f"the server is stopping: model {name!r} was not {op}ed")
            asked = [(c, c.channel.ask("apply", (op, name, parameters))) for c in self.children]
            failures: list[tuple[_Child, BaseException]] = []
            for c, future in asked:
                try:
                    future.result()
                except Exception as e:  # noqa: BLE001
                    failures.append((c, e))
        if failures:
            if len(failures) < len(asked):
                where = ", ".join(str(c.index) for c, _ in failures)
                log.warning("%s of model %r failed in server process(es) %s only: %s", op, name, where, failures[0][1])
            raise failures[0][1]

    def _metrics(self) -> bytes:
        from prometheus_client import generate_latest

        asked = [c.channel.ask("metrics") for c in self.children if c.up]
        deadline = time.monotonic() + METRICS_TIMEOUT_S
        snapshots = []
        for future in asked:
            try:
                snapshots.append(future.result(max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise NeuropodError(
                    f"a server process did not send its metrics within {METRICS_TIMEOUT_S:g} s"
                ) from None
        return generate_latest(_Families(merge_families(snapshots)))

    def broadcast_ready(self, ready: bool) -> None:
        for c in self.children:
            try:
                c.channel.send(("ready", ready))
            except OSError:
                pass

    def stop(self) -> None:
        """SIGTERM every process still running, wait :data:`STOP_S` for them, kill what is left."""
        self.stopping = True
        self.broadcast_ready(False)
        for c in self.children:
            if c.process.is_alive():
                try:
                    os.kill(c.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_S
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                log.error("server process %d (pid %d) did not stop within %g s of SIGTERM; killing it", c.index,
                          c.process.pid, STOP_S)  # fmt: skip
                c.process.kill()
                c.process.join()
        for c in self.children:
            c.channel.conn.close()
            if c.reader is not None:
                c.reader.join(1.0)
        self.all_up.set()  # frees a repository request waiting for a start that will not come
        self._pool.shutdown(wait=False, cancel_futures=True)

    def dead(self) -> _Child | None:
        """A process that has exited, if any."""
        return next((c for c in self.children if c.process.exitcode is not None), None)


class _Families:
    """A collector of fixed metric families, for prometheus-client's ``generate_latest``."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def merge_families(snapshots: list[list[Any]]) -> list[Any]:
    """One process's worth of metric families from each process's: every sample summed over the
    processes that have it, except gauges (``neuropod_models_loaded``), which take the smallest;
    plus ``neuropod_server_processes``, how many processes there were."""
    from prometheus_client.core import GaugeMetricFamily, Metric

    merged: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], Any]] = {}
    for families in snapshots:
        for family in families:
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            samples = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                seen = samples.get(key)
                if seen is None:
                    samples[key] = s
                else:
                    value = min(seen.value, s.value) if family.type == "gauge" else seen.value + s.value
                    samples[key] = seen._replace(value=value)
    for name, family in merged.items():
        family.samples = list(values[name].values())
    processes = GaugeMetricFamily(
        "neuropod_server_processes", "Server processes whose metrics these are (neuropod serve --processes)",
        value=len(snapshots),
    )  # fmt: skip
    return [*merged.values(), processes]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), what ``--processes auto`` starts."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_options(args: argparse.Namespace, processes: int) -> None:
    """Refuse what cannot work with ``processes`` server processes, naming the options.

    :raises NeuropodError: an option that cannot be combined with --processes, or a platform without SO_REUSEPORT.
    """
    import socket

    if getattr(args, "ray", False):
        raise NeuropodError(
            f"--processes {processes} cannot be combined with --ray: Ray Serve runs the replicas "
            "(use --replicas N for more of them)"
        )
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        raise NeuropodError(
            f"--processes {processes} needs Linux: the processes share the ports with SO_REUSEPORT, which only "
            f"Linux spreads over them (this is {sys.platform}); serve with --processes 1"
        )
    if getattr(args, "allow_client_shm", False):
        raise NeuropodError(
            f"--allow-client-shm cannot be combined with --processes {processes}: a shared-memory region "
            "is registered with the one process that received the request, and the client's next request "
            "may reach another; serve with --processes 1 to take tensors in shared memory"
        )


def run_group(args: argparse.Namespace, processes: int, out: TextIO, serving_line: Any) -> int:
    """Start ``processes`` server processes, wait until they all listen, say where, and supervise them
    until SIGINT or SIGTERM (exit status 0) or until one of them dies (1).

    :param serving_line: ``(models, processes) -> str``, the line printed once all listen (None: nothing).
    :raises NeuropodError: a process could not start (a bad package, a port in use...): its message.
    """
    group = _Group(args, processes)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        group.changed.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        group.start()
        announced = False
        while not stop.is_set():
            group.changed.wait(0.5)
            group.changed.clear()
            if group.failure is not None and not announced:
                raise NeuropodError(group.failure)
            dead = group.dead()
            if dead is not None and not stop.is_set():
                if not announced:
                    time.sleep(0.2)  # its message, if it sent one, may still be on its way
                    if group.failure is not None:
                        raise NeuropodError(group.failure)
                    raise NeuropodError(
                        f"server process {dead.index} (pid {dead.process.pid}) exited with status "
                        f"{dead.process.exitcode} while loading the models"
                    )
                time.sleep(0.2)  # its message, if it sent one, may still be on its way
                why = f" ({group.failure})" if group.failure is not None else ""
                log.error(
                    "server process %d (pid %d) exited with status %s%s; stopping the other %d and exiting with "
                    "status 1 (restart `neuropod serve` to serve again)", dead.index, dead.process.pid,
                    dead.process.exitcode, why, processes - 1,
                )  # fmt: skip
                status = 1
                break
            if not announced and group.all_up.is_set():
                announced = True
                group.broadcast_ready(True)
                if serving_line is not None:
                    print(serving_line(group.children[0].models, processes), file=out, flush=True)
    finally:
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


__all__ = ["GroupMember", "check_options", "merge_families", "run_group", "usable_cpus"]
