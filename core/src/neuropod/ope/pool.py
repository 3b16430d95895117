"""The workers of one model: :class:`WorkerPool` hands each call to an idle worker process, and
:func:`start_pool` starts one for a model (see :mod:`neuropod.ope` for what out-of-process
execution promises)."""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod._args import check_flag, check_seconds, check_workers
from neuropod.errors import NeuropodError, WorkerError
from neuropod.ope._channel import Block
from neuropod.ope.fingerprint import package_fingerprint
from neuropod.ope.process import HandedBlock, WorkerProcess
from neuropod.ope.sequences import declaration
from neuropod.package import Package

#: Seconds a closed worker gets to exit by itself before it is killed.
_STOP_WAIT = 2.0

_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child's copies of the lifelines would keep workers alive after their parent died, and its
    # copies of the pipes would keep a closed channel open: drop them (the parent keeps its own).
    for pool in list(_live_pools):
        pool.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class WorkerPool:
    """The workers of one model, handing each call to an idle one."""

    def __init__(
        self, name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
        workers: int, restart: bool, timeout: float | None, gpu_uuid: str | None, package: Package | None,
        sequences: str | None = None,
    ):  # fmt: skip
        self.name = name
        #: A stateful model's ``state_spec`` and ``sequence_controls`` (JSON), sent to each worker
        #: after it loads the model: the worker keeps its sequences' state. Its calls name their
        #: worker (:meth:`take_worker`); None for other models, whose calls take any idle one.
        self.sequences = sequences
        self.pinned = sequences is not None
        self.python = python
        self.package_root = package_root
        self.backend_id = backend_id
        self.options = dict(options)
        self.restart = restart
        self.timeout = timeout
        self.pid = os.getpid()
        self.closed = False
        # Reentrant: a model's finalizer (close) may run from garbage collection in any thread.
        self.lock = threading.RLock()
        self.handed: dict[int, HandedBlock] = {}
        self.handed_gen = 0
        self.forgotten: queue.SimpleQueue[HandedBlock] = queue.SimpleQueue()
        self._ids = iter(range(1, 1 << 62))
        env = dict(os.environ)
        if os.path.realpath(python) != os.path.realpath(sys.executable):
            # Another environment's interpreter must not see this one's paths.
            env.pop("PYTHONPATH", None)
            env.pop("PYTHONHOME", None)
        # The worker sees only its own GPU (by UUID, stable across renumbering), or none.
        env["CUDA_VISIBLE_DEVICES"] = gpu_uuid or ""
        self.env = env
        self.worker_device = "cuda:0" if gpu_uuid else "cpu"
        self.device = device
        self.fingerprint = package_fingerprint(package_root, package) if restart else None
        #: Calls the workers answered, and the seconds their backend spent in ``infer`` for them.
        self.runs = 0
        self.run_s = 0.0
        #: Workers held by open streams, each with the thread that took it (see :meth:`take`).
        self.stream_workers: dict[WorkerProcess, int] = {}
        self.workers = [WorkerProcess(self) for _ in range(workers)]
        self.idle: queue.SimpleQueue[WorkerProcess] = queue.SimpleQueue()
        try:
            for w in self.workers:
                w.start()
                if not self.pinned:
                    self.idle.put(w)
            if self.fingerprint is not None:
                self.fingerprint.wait()
        except BaseException:
            self.close()
            raise
        _live_pools.add(self)

    def new_block_id(self) -> int:
        with self.lock:
            return next(self._ids)

    def _check_usable(self) -> None:
        if os.getpid() != self.pid:
            raise WorkerError(
                f"Model {self.name!r} was loaded in process {self.pid}, and this is a forked child (pid "
                f"{os.getpid()}): a model's workers cannot cross fork(). Load the model again in the child "
                "(for example in a post-fork hook), or load it only after forking."
            )
        if self.closed:
            raise NeuropodError(f"Model {self.name!r} is closed")

    def infer(
        self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        worker = self.take()
        try:
            if parameters is None:
                return worker.infer(inputs, requested)
            return worker.infer(inputs, requested, parameters)
        finally:
            self.give_back(worker)

    def take(self) -> WorkerProcess:
        """An idle worker, ready for a call (restarted after a failure when allowed): hand it back
        with :meth:`give_back`. Raises (the worker handed back) when it cannot serve."""
        if self.pinned:  # a stateful model's calls name their worker; any other takes a free one
            worker = next((w for w in self.workers if not w.lock.locked()), self.workers[0])
            taken = self.take_worker(worker)
            assert taken is not None
            return taken
        self._check_usable()
        if not self.forgotten.empty():
            self._collect()
        if self.stream_workers:
            self._check_not_waiting_on_self()
        worker = self.idle.get()
        self._ready(worker)
        return worker

    def take_worker(self, worker: WorkerProcess, wait: bool = True) -> WorkerProcess | None:
        """:meth:`take` for a pinned pool: this worker, once its call (if any) is done; None when
        it is busy and not ``wait``. Hand it back with :meth:`give_back`."""
        self._check_usable()
        if not self.forgotten.empty():
            self._collect()
        if not worker.lock.acquire(wait):
            return None
        self._ready(worker)
        return worker

    def _ready(self, worker: WorkerProcess) -> None:
        """Make a taken worker ready for a call, or hand it back and raise."""
        try:
            if self.closed:  # while this call waited for a worker
                raise NeuropodError(f"Model {self.name!r} is closed")
            if worker.ending_stream:  # a stream dropped unread: read the worker's answer to its end
                worker.end_abandoned_stream()
            if worker.failed:
                if not self.restart:
                    raise WorkerError(
                        f"The worker for model {self.name!r} has stopped: {worker.reason}. "
                        "Load the model again, or pass restart=True to start a new worker after a failure."
                    )
                worker.restart()
            elif not worker.alive:  # died between calls: say so now, restart (if allowed) on the next call
                raise worker._failure("died")
        except BaseException:
            self.give_back(worker)
            raise

    def give_back(self, worker: WorkerProcess) -> None:
        """Make ``worker`` idle again (after a call, or a stream's end)."""
        if self.closed and self._own():
            worker._teardown()
        if self.pinned:
            worker.lock.release()
        else:
            self.idle.put(worker)

    def take_for_stream(self) -> WorkerProcess:
        """:meth:`take`, for a stream that holds the worker until :meth:`stream_ended`."""
        worker = self.take()
        with self.lock:
            self.stream_workers[worker] = threading.get_ident()
        return worker

    def stream_ended(self, worker: WorkerProcess) -> None:
        """A stream gives back the worker it held."""
        with self.lock:
            self.stream_workers.pop(worker, None)
        self.give_back(worker)

    def _check_not_waiting_on_self(self) -> None:
        """Refuse a call that would wait for ever: every worker is held by a stream this thread reads."""
        me = threading.get_ident()
        with self.lock:
            held = sum(1 for thread in self.stream_workers.values() if thread == me)
        if held >= len(self.workers):
            raise NeuropodError(
                f"Every worker of model {self.name!r} ({held}) is held by a stream this thread has open and "
                "not finished: this call would wait for one of them for ever. Read those streams to their end "
                "or close them first, or load the model with more workers (workers=N)"
            )

    def _own(self) -> bool:
        return os.getpid() == self.pid

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array in a new shared-memory block (arguments checked by the caller)."""
        self._check_usable()
        if not self.forgotten.empty():
            self._collect()
        nbytes = math.prod(shape) * dtype.itemsize
        block, fd = Block.create(self.new_block_id(), nbytes)
        whole = block.fresh()
        arr = whole[:nbytes].view(dtype).reshape(shape)
        handed = HandedBlock(block, fd, whole, arr)
        with self.lock:
            self.handed[handed.key] = handed
        # Only the queue: collecting (closing the descriptor) happens in an ordinary call, never inside GC.
        weakref.finalize(whole, self.forgotten.put, handed)
        return arr

    def _collect(self) -> None:
        """Forget the blocks of empty() arrays that are gone; the workers unmap them on their next call."""
        gone = []
        with self.lock:
            while True:
                try:
                    h = self.forgotten.get_nowait()
                except queue.Empty:
                    break
                if self.handed.get(h.key) is h:
                    del self.handed[h.key]
                    gone.append(h)
            self.handed_gen += 1
        for h in gone:
            os.close(h.fd)

    def close(self) -> None:
        """Stop the workers: an idle one gets a moment to exit by itself, a busy one is killed."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _live_pools.discard(self)
        if not self._own():
            return  # a forked child: the workers are its parent's
        idle = []
        while not self.pinned:
            try:
                idle.append(self.idle.get_nowait())
            except queue.Empty:
                break
        if self.pinned:
            idle = [w for w in self.workers if w.lock.acquire(False)]
        for w in self.workers:
            if w not in idle:
                w.kill()  # its call fails now; the thread that runs it tears the worker down
        for w in idle:
            if w.channel is not None:
                w.channel.close()
                w.channel = None
        deadline = time.monotonic() + _STOP_WAIT
        for w in idle:
            w._teardown(deadline)
        with self.lock:
            # Workers that open streams hold may never be given back (a stream nobody reads): a call
            # waiting for a worker must not wait for them.
            idle += [w for w in self.stream_workers if w not in idle]
        for w in idle:  # a call that passed the closed check before close() must not wait forever
            if self.pinned:
                w.lock.release()
            else:
                self.idle.put(w)
        with self.lock:
            handed, self.handed = list(self.handed.values()), {}
        for h in handed:
            os.close(h.fd)  # the arrays keep their mapping; only resending them needed the descriptor

    def forget_after_fork(self) -> None:
        for w in self.workers:
            w.forget_after_fork()


def _check_start_args(workers: object, restart: object, timeout: object) -> None:
    check_workers(workers)
    check_flag("restart", restart)
    check_seconds("timeout", timeout)


def start_pool(
    name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
    *, workers: int = 1, restart: bool = False, timeout: float | None = None, gpu_uuid: str | None = None,
    package: Package | None = None,
) -> WorkerPool:  # fmt: skip
    """Start the worker(s) for one model; each loads it before this returns.

    :param package: the package as the caller read (and verified) it: with
        ``restart=True``, a restart checks the files against its manifest.
        Without it, the manifest on disk is read now.
        A stateful package (its config as amended at load, if it was) makes a pool whose
        workers keep the state of its sequences (see :mod:`neuropod.ope.sequences`).
    :raises TypeError, ValueError: ``workers``, ``restart`` or ``timeout`` is of the wrong type or value.
    """
    _check_start_args(workers, restart, timeout)
    if not sys.platform.startswith("linux"):
        raise NeuropodError("Out-of-process execution needs Linux (memfd shared memory)")
    return WorkerPool(
        name, python, package_root, backend_id, device, options, int(workers), bool(restart),
        None if timeout is None else float(timeout), gpu_uuid, package,
        None if package is None else declaration(package.config),
    )  # fmt: skip


__all__ = ["WorkerPool", "start_pool"]
