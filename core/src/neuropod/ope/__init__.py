"""Out-of-process execution: a model in its own worker process(es).

``load_neuropod(path, use_ope=True)`` (and any model whose chosen backend lives
in a backend environment) returns a :class:`WorkerModel`: the same ``infer``,
spec checks and errors as in-process, with the model loaded in a worker
started from the backend's Python. Tensors cross through shared memory (see
:mod:`neuropod.ope._channel`); only names, dtypes, shapes and block ids cross
the control channel.

* Inputs are copied once into blocks that are reused across calls, or not at
  all when they were made with :meth:`WorkerModel.empty`.
* Outputs come back as numpy arrays over shared memory, with no copy after the
  worker's; a block is reused only once the arrays over it are gone.
* A worker that dies gives a :class:`~neuropod.errors.WorkerError` at once,
  with its exit status and the end of its stderr; ``restart=True`` starts a
  new one on the next call. Workers die with their parent (PR_SET_PDEATHSIG
  and the closed channel), and blocks are anonymous memory, so nothing is
  left behind whichever side is killed.
"""

from __future__ import annotations

import mmap
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod import errors
from neuropod.errors import NeuropodError, WorkerError
from neuropod.ope._channel import PROTOCOL, Block, Channel, ChannelClosed, dtype_of
from neuropod.spec import to_string_array

_STDERR_TAIL = 4000


class _Handed:
    """A block handed to the caller by ``empty()``: inputs over it are not copied."""

    def __init__(self, block: Block, fd: int):
        self.block = block
        self.fd = fd  # kept open: each worker (and a restarted one) gets its own copy


class _Worker:
    """One worker process and the blocks it shares with this process."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self.failed = False

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        pool = self.pool
        channel, (read_fd, write_fd, sock) = Channel.pair()
        channel.timeout = pool.timeout
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        theirs = [read_fd, write_fd, sock.fileno()]
        try:
            self.proc = subprocess.Popen(
                [pool.python, "-m", "neuropod.ope.worker", *map(str, theirs), str(os.getpid())],
                pass_fds=theirs,
                env=pool.env,
                stdin=subprocess.DEVNULL,
                stdout=self.stderr,
                stderr=self.stderr,
            )
        except OSError as e:
            channel.close()
            raise WorkerError(f"Cannot start a worker with {pool.python}: {e}") from e
        finally:
            # Only the worker may hold its ends: a dead worker must mean EOF here.
            os.close(read_fd)
            os.close(write_fd)
            sock.close()
        self.channel = channel
        self.in_blocks: dict[str, Block] = {}
        self.in_views: dict[str, tuple[Block, str, tuple[int, ...], np.ndarray]] = {}
        self.out_blocks: dict[int, Block] = {}
        self.out_refs: dict[int, weakref.ref[np.ndarray]] = {}
        self.known_handed: set[int] = set()
        self.layout: list[tuple[str, np.dtype[Any], tuple[int, ...], np.ndarray | None]] | None = None
        self.failed = False
        reply = self._request(("load", PROTOCOL, pool.package_root, pool.backend_id, pool.worker_device, pool.options), [])
        self.pid, self.backend_id, self.python = reply[1], reply[2], reply[3]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.channel is not None

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()  # the worker sees the channel close and exits
            self.channel = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.in_blocks, self.in_views, self.out_blocks, self.out_refs = {}, {}, {}, {}
        if hasattr(self, "stderr"):
            self.stderr.close()

    def _failure(self, what: str) -> WorkerError:
        """The worker is gone or stuck: stop it and describe why, with the end of its stderr."""
        proc = self.proc
        status = "still running"
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                status = f"killed after it {what}"
            else:
                status = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        tail = ""
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - _STDERR_TAIL))
            tail = self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            pass
        pid = proc.pid if proc is not None else "?"
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        self.failed = True
        restart = " It will be restarted on the next call." if self.pool.restart else ""
        return WorkerError(
            f"The worker for model {self.pool.name!r} (pid {pid}, {self.pool.python}) {what} ({status}).{restart}"
            + (f"\nEnd of the worker's stderr:\n{tail}" if tail else "\nThe worker wrote nothing to stderr.")
        )

    def _request(self, message: tuple[Any, ...], fds: list[int]) -> tuple[Any, ...]:
        channel = self.channel
        if channel is None:
            raise WorkerError(f"The worker for model {self.pool.name!r} is not running")
        try:
            channel.send(message, fds)
            reply, reply_fds = channel.recv()
        except TimeoutError:
            raise self._failure(f"did not answer within {self.pool.timeout} s") from None
        except ChannelClosed:
            raise self._failure("died") from None
        if reply[0] == "error":
            for fd in reply_fds:
                os.close(fd)
            raise _worker_exception(reply, self.pool.name)
        self._reply_fds = reply_fds
        return reply  # type: ignore[no-any-return]

    # -- one call ----------------------------------------------------------------

    def _same_layout(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Copy the inputs into last call's blocks when names, dtypes and shapes are all the same.

        The common case of a model called again and again: one copy per
        input, and the worker reuses its views (the request says "same").
        """
        layout = self.layout
        if layout is None or len(layout) != len(inputs):
            return False
        # One pass that checks and copies: a mismatch half-way only wastes copies the slow path redoes.
        for (name, dtype, shape, view), (given, arr) in zip(layout, inputs.items()):
            if given != name or arr.dtype is not dtype or arr.shape != shape or view is None:
                return False
            view[...] = arr
        return True

    def infer(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        reusable = [b for b, ref in self.out_refs.items() if ref() is None]
        wanted = None if requested is None else tuple(requested)
        if self._same_layout(inputs):
            return self._finish(self._request(("infer", None, wanted, [], reusable), []))
        new: list[tuple[int, int]] = []
        fds: list[int] = []
        sent: list[tuple[str, int, str, tuple[int, ...]]] = []
        layout: list[tuple[str, np.dtype[Any], tuple[int, ...], np.ndarray | None]] = []
        handed = self.pool.handed
        for name, arr in inputs.items():
            base: Any = arr.base
            if type(base) is mmap.mmap and id(base) in handed and arr.flags.c_contiguous:
                h = handed[id(base)]
                if arr.ctypes.data == h.block.address:  # the whole array made by empty(): no copy
                    if h.block.id not in self.known_handed:
                        new.append((h.block.id, h.block.size))
                        fds.append(h.fd)
                        self.known_handed.add(h.block.id)
                    sent.append((name, h.block.id, arr.dtype.str, arr.shape))
                    layout.append((name, arr.dtype, arr.shape, None))
                    continue
            if arr.dtype.kind == "O":  # object arrays of str cross as fixed-width unicode
                arr = to_string_array(arr)
            dt, shape = arr.dtype.str, arr.shape
            cached = self.in_views.get(name)
            if cached is not None and cached[1] == dt and cached[2] == shape:
                block, view = cached[0], cached[3]
            else:
                block = self.in_blocks.get(name)  # type: ignore[assignment]
                if block is None or block.size < arr.nbytes:
                    block, fd = Block.create(self.pool.new_block_id(), arr.nbytes)
                    self.in_blocks[name] = block
                    new.append((block.id, block.size))
                    fds.append(fd)
                view = block.view(dtype_of(dt), shape)
                self.in_views[name] = (block, dt, shape, view)
            np.copyto(view, arr)
            sent.append((name, block.id, dt, shape))
            layout.append((name, arr.dtype, shape, view))
        try:
            reply = self._request(("infer", sent, wanted, new, reusable), fds)
        finally:
            for fd in fds:
                if not any(fd == h.fd for h in handed.values()):
                    os.close(fd)
        # Inputs made by empty() are not copied, so they cannot take the copying fast path.
        self.layout = None if any(entry[3] is None for entry in layout) else layout
        return self._finish(reply)

    def _finish(self, reply: tuple[Any, ...]) -> dict[str, np.ndarray]:
        _, outputs, created = reply
        for (block_id, size), fd in zip(created, self._reply_fds):
            self.out_blocks[block_id] = Block.attach(block_id, fd, size)
        result = {}
        for name, block_id, dt, shape in outputs:
            arr = self.out_blocks[block_id].view(dtype_of(dt), tuple(shape))
            self.out_refs[block_id] = weakref.ref(arr)
            result[name] = arr
        return result


class _Pool:
    """The workers of one model, handing each call to an idle one."""

    def __init__(
        self, name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
        workers: int, restart: bool, timeout: float | None, gpu_uuid: str | None,
    ):  # fmt: skip
        self.name = name
        self.python = python
        self.package_root = package_root
        self.backend_id = backend_id
        self.options = dict(options)
        self.restart = restart
        self.timeout = timeout
        self.handed: dict[int, _Handed] = {}
        self._ids = iter(range(1, 1 << 62))
        self._id_lock = threading.Lock()
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
        self.workers = [_Worker(self) for _ in range(workers)]
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        try:
            for w in self.workers:
                w.start()
                self.idle.put(w)
        except BaseException:
            self.close()
            raise

    def new_block_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def infer(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        worker = self.idle.get()
        try:
            if worker.failed:
                if not self.restart:
                    raise WorkerError(
                        f"The worker for model {self.name!r} has stopped; load the model again or pass restart=True"
                    )
                worker.stop()
                worker.start()
            elif not worker.alive:  # died between calls: say so now, restart (if allowed) on the next call
                raise worker._failure("died")
            return worker.infer(inputs, requested)
        finally:
            self.idle.put(worker)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block, fd = Block.create(self.new_block_id(), nbytes)
        arr = block.view(dtype, shape)
        self.handed[id(block.mm)] = handed = _Handed(block, fd)
        weakref.finalize(arr, self._forget, id(block.mm), handed)
        return arr

    def _forget(self, key: int, handed: _Handed) -> None:
        if self.handed.get(key) is handed:
            del self.handed[key]
        os.close(handed.fd)

    def close(self) -> None:
        for w in self.workers:
            w.stop()


def _worker_exception(reply: tuple[Any, ...], model: str) -> NeuropodError:
    _, cls_name, message, tb = reply
    cls = getattr(errors, cls_name, None)
    if isinstance(cls, type) and issubclass(cls, NeuropodError):
        exc = cls(message)
    else:
        exc = errors.BackendError(f"The worker for model {model!r} failed: {cls_name}: {message}\nWorker traceback:\n{tb}")
    exc.worker_traceback = tb  # type: ignore[attr-defined]
    return exc


def start_pool(
    name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
    *, workers: int = 1, restart: bool = False, timeout: float | None = None, gpu_uuid: str | None = None,
) -> _Pool:  # fmt: skip
    """Start the worker(s) for one model; each loads it before this returns."""
    if workers < 1:
        raise NeuropodError(f"workers must be at least 1, not {workers}")
    if not sys.platform.startswith("linux"):
        raise NeuropodError("Out-of-process execution needs Linux (memfd shared memory)")
    return _Pool(name, python, package_root, backend_id, device, options, workers, restart, timeout, gpu_uuid)


__all__ = ["start_pool"]
