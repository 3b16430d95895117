"""Out-of-process execution: a model in its own worker process(es).

``load_neuropod(path, use_ope=True)`` (and any model whose chosen backend lives
in a backend environment) returns a :class:`WorkerModel`: the same ``infer``,
spec checks and errors as in-process, with the model loaded in a worker
started from the backend's Python. Tensors cross through shared memory (see
:mod:`neuropod.ope._channel`); only names, dtypes, shapes, offsets and block
ids cross the control channel.

* Inputs are copied once into one block per worker that is reused across
  calls (grown when a call needs more), or not at all when they were made
  with :meth:`WorkerModel.empty`. Outputs come back as numpy arrays over
  one shared block per call, with no copy after the worker's; a block is
  reused only once no array over it (or over a view of it) is left. A
  mapped block holds no file descriptor, so a call with hundreds of tensors
  needs no more descriptors than a call with one; each ``empty()`` array
  keeps one (to hand its block to a restarted worker) until it is
  garbage-collected, and the workers then unmap it too.
* String tensors cross as UTF-8 bytes and offsets, so one long string does
  not pad the others, and every character (NUL included, trailing or not)
  arrives as sent. Each side gets the kind of array the other gave: numpy
  unicode stays unicode, an object array of ``str`` stays one (numpy unicode
  arrays cannot hold a trailing NUL; use object arrays for such strings).
* A worker that dies gives a :class:`~neuropod.errors.WorkerError` at once,
  with its exit status and the end of its stderr. ``timeout=`` bounds each
  call: a worker that has not answered within it is killed, and the call
  raises a WorkerError within the timeout plus a few milliseconds. Then,
  with ``restart=True``, the next call starts a new worker (and waits for it
  to load the model: the timeout bounds answers, not loading); without it,
  every later call raises a WorkerError saying why the worker stopped.
* A restart serves the model that was first loaded or none: before a new
  worker starts, the package's files are checked against the manifest read
  at the first load (or, for packages without a manifest, such as original
  0.3 ones, against the sha256 of every file taken at the first load), and a
  changed, added or missing file is a :class:`~neuropod.errors.PackageError`
  naming it. Load the model again to serve the files as they are now.
* Workers live as long as the process that loaded them, whichever thread
  did: the kernel kills a worker the moment that process exits or is killed,
  even mid-inference (see :mod:`neuropod.ope.worker`). A model dropped
  without ``close()`` stops its workers when it is garbage-collected, and
  at interpreter exit.
* A model cannot cross ``fork()``: in a forked child, ``infer`` and
  ``empty`` raise a WorkerError saying so (load the model again in the
  child), and the child's exit leaves the parent's workers alone.
* When a system limit stops shared memory or a worker (open files, memory),
  the WorkerError names the limit and its current value.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod import errors
from neuropod._args import check_flag, check_seconds, check_workers
from neuropod.errors import NeuropodError, PackageError, WorkerError
from neuropod.ope._channel import (
    PROTOCOL,
    STRING_KINDS,
    Block,
    Channel,
    ChannelClosed,
    DescriptorsLost,
    aligned,
    dtype_of,
    get_strings,
    limit_error,
    put_strings,
    string_bytes,
    string_size,
)

if TYPE_CHECKING:
    from neuropod.package import Package

_STDERR_TAIL = 4000
#: Seconds a closed worker gets to exit by itself before it is killed.
_STOP_WAIT = 2.0
#: Seconds a worker whose channel closed gets to finish dying (e.g. a fault handler writing its stack).
_DEATH_WAIT = 5.0
_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN)

_live_pools: weakref.WeakSet[_Pool] = weakref.WeakSet()
_Place = tuple[str, "np.dtype[Any]", tuple[int, ...], "np.ndarray | None"]


def _after_fork_in_child() -> None:
    # The child's copies of the lifelines would keep workers alive after their parent died, and its
    # copies of the pipes would keep a closed channel open: drop them (the parent keeps its own).
    for pool in list(_live_pools):
        pool.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Handed:
    """A block handed to the caller by ``empty()``: inputs over it are not copied."""

    __slots__ = ("arr", "block", "fd", "key", "ref")

    def __init__(self, block: Block, fd: int, whole: np.ndarray, arr: np.ndarray):
        self.block = block
        self.fd = fd  # kept open: each worker (and a restarted one) gets its own copy
        self.key = id(whole)
        self.ref = weakref.ref(whole)  # the base of every array made over it
        self.arr = weakref.ref(arr)  # the array handed out: passed as it is, it needs no address check


class _Fingerprint:
    """What the package's files were at the first load, checked before a worker restarts."""

    def __init__(self, package: Package):
        self.package = package
        self.root = package.root
        self.source = package.source
        self.manifest = dict(package.manifest) if package.manifest is not None else None
        self.hashes: dict[str, str] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.manifest is None:
            # Hashed while the workers start, so loading does not wait for it.
            self._thread = threading.Thread(target=self._hash_all, name="neuropod-fingerprint", daemon=True)
            self._thread.start()

    def _hash_all(self) -> None:
        try:
            self.hashes = {rel: _file_sha256(self.root / rel) for rel in self.package.files()}
        except (OSError, PackageError) as e:  # reported by check(): a restart cannot be proven safe
            self.error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self, model: str) -> dict[str, tuple[int, int, int]]:
        """Raise a PackageError unless every file is as it was; returns the files' (size, mtime, inode)."""
        self.wait()
        try:
            if self.manifest is not None:
                expected, what = self.manifest, "the manifest read when the model was loaded"
                present = set(self.package.files()) - {"manifest.json"}
            elif self.hashes is not None:
                expected, what = self.hashes, "the files as they were when the model was loaded"
                present = set(self.package.files())
            else:
                raise PackageError(f"its files could not be read when the model was loaded ({self.error})")
            problems = []
            changed = sorted(f for f in present & set(expected) if _file_sha256(self.root / f) != expected[f])
            for label, names in (("changed", changed), ("missing", sorted(set(expected) - present)),
                                 ("added", sorted(present - set(expected)))):  # fmt: skip
                if names:
                    problems.append(f"{label}: {', '.join(names[:20])}" + (" ..." if len(names) > 20 else ""))
            if problems:
                raise PackageError(f"it does not match {what} ({'; '.join(problems)})")
            return self.stats(present)
        except PackageError as e:
            raise PackageError(
                f"Cannot restart the worker for model {model!r}: its package {self.source} (files in {self.root}) "
                f"has changed on disk since the model was loaded: {e}. A restart must serve the model that was "
                "loaded: restore the files, or load the model again to serve them as they are now."
            ) from None

    def stats(self, files: set[str] | None = None) -> dict[str, tuple[int, int, int]]:
        out = {}
        for rel in sorted(files if files is not None else self.package.files()):
            try:
                st = os.stat(self.root / rel)
            except OSError:
                continue
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out


def _file_sha256(path: Path) -> str:
    # O_NONBLOCK and the S_ISREG check: a FIFO or device put in place of a file is refused, not waited on.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise PackageError(f"cannot read {path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackageError(f"{path} is not a regular file")
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Worker:
    """One worker process and the blocks it shares with this process."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self.lifeline: Any = None  # our end of the lifeline pipe: closing it kills the worker
        self.stderr: Any = None
        self.failed = False
        self.reason = ""
        self.pid = 0
        self._reply_fds: list[int] = []
        self._reset()

    def _reset(self) -> None:
        self.arena: Block | None = None  # the block this worker's inputs are copied into
        # Last call's inputs: (name, dtype, shape, view in the arena), the view None for an empty() array.
        self.layout: list[_Place] | None = None
        self.layout_handed: dict[str, weakref.ref[np.ndarray]] = {}
        self.out_blocks: dict[int, Block] = {}
        self.out_leases: dict[int, weakref.ref[np.ndarray]] = {}
        self.known_handed: set[int] = set()
        self.handed_gen = -1
        self.drops: list[int] = []

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Start the process and load the model; on any failure nothing of it is left running."""
        pool = self.pool
        self._teardown()
        try:
            channel, (read_fd, write_fd, sock) = Channel.pair()
        except OSError as e:
            raise limit_error(e, f"start a worker for model {pool.name!r}") from None
        theirs = [read_fd, write_fd, sock.fileno()]
        try:
            life_r, life_w = os.pipe()
        except OSError as e:
            channel.close()
            for fd in theirs[:2]:
                os.close(fd)
            sock.close()
            raise limit_error(e, f"start a worker for model {pool.name!r}") from None
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        try:
            self.proc = subprocess.Popen(
                [pool.python, "-m", "neuropod.ope.worker", *map(str, theirs), str(os.getpid()), str(life_r)],
                pass_fds=[*theirs, life_r],
                env=pool.env,
                stdin=subprocess.DEVNULL,
                stdout=self.stderr,
                stderr=self.stderr,
            )
        except OSError as e:
            channel.close()
            os.close(life_w)
            self.stderr.close()
            self.stderr = None
            if e.errno in _LIMIT_ERRNOS:
                raise limit_error(e, f"start a worker for model {pool.name!r} with {pool.python}") from None
            raise WorkerError(f"Cannot start a worker for model {pool.name!r} with {pool.python}: {e}") from e
        finally:
            # Only the worker may hold its ends: a dead worker must mean EOF here, a dead client its lifeline's hangup.
            os.close(read_fd)
            os.close(write_fd)
            sock.close()
            os.close(life_r)
        # A file object: if this worker is ever dropped without stop(), garbage collection closes it,
        # and the kernel kills the worker.
        self.lifeline = os.fdopen(life_w, "wb", buffering=0)
        self.channel = channel
        self.failed = False
        self.reason = ""
        try:
            reply = self._request(("load", PROTOCOL, pool.package_root, pool.backend_id, pool.worker_device, pool.options), [], None)
        except BaseException as e:
            self._teardown()
            self.failed = True
            self.reason = f"it failed to load the model: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            raise
        self.pid, self.backend_id, self.python = reply[1], reply[2], reply[3]

    def restart(self) -> None:
        """Start a new worker after a failure, only if the package's files are still those first loaded."""
        pool = self.pool
        fingerprint = pool.fingerprint
        assert fingerprint is not None  # made whenever restart=True
        self._teardown()
        before = fingerprint.check(pool.name)
        self.start()
        # A file swapped while the new worker was reading it: cheap to catch by its size, time and inode.
        if fingerprint.stats(set(before)) != before:
            self._teardown()
            self.failed = True
            self.reason = "its package changed on disk while it restarted"
            raise PackageError(
                f"Cannot restart the worker for model {pool.name!r}: files of its package {fingerprint.source} "
                "changed while the new worker loaded them. Load the model again to serve the files as they are now."
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.channel is not None and self.proc.poll() is None

    def _own(self) -> bool:
        return os.getpid() == self.pool.pid

    def _teardown(self, deadline: float | None = None) -> None:
        """Close the channel, end the process (after ``deadline`` at the latest), free every block."""
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()  # an idle worker sees the channel close and exits by itself
        proc = self.proc
        if proc is not None and self._own():
            if deadline is not None and proc.poll() is None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._close_lifeline()  # the kernel kills the worker if it is still there
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=_DEATH_WAIT)
                except subprocess.TimeoutExpired:
                    pass  # stuck in the kernel (a driver call): nothing more can be done from here
        self._close_lifeline()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        self._reset()

    def _close_lifeline(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    def kill(self) -> None:
        """End the process now (from another thread, while a call may be using the channel)."""
        proc = self.proc
        if proc is not None and self._own() and proc.poll() is None:
            proc.kill()

    def forget_after_fork(self) -> None:
        """In a forked child: drop this process's copies of the worker's pipes, touch nothing else."""
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _failure(self, what: str, *, kill: bool = False) -> WorkerError:
        """The worker is gone or stuck: end it, describe why with the end of its stderr; it is failed from now on."""
        proc = self.proc
        status = "still running"
        if proc is not None and self._own():
            if kill:
                proc.kill()
            try:
                code = proc.wait(timeout=_DEATH_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                status = f"killed after it {what}"
            else:
                if kill:
                    status = "killed"
                elif code < 0:
                    status = f"killed by signal {signal.Signals(-code).name}"
                else:
                    status = f"exit status {code}"
        tail = ""
        try:
            if self.stderr is not None:
                self.stderr.seek(0, os.SEEK_END)
                size = self.stderr.tell()
                self.stderr.seek(max(0, size - _STDERR_TAIL))
                tail = self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            pass
        pid = proc.pid if proc is not None else "?"
        self._teardown()
        self.failed = True
        self.reason = f"it {what} ({status})"
        if self.pool.closed:
            return WorkerError(f"Model {self.pool.name!r} was closed during the call")
        restart = " It will be restarted on the next call." if self.pool.restart else ""
        return WorkerError(
            f"The worker for model {self.pool.name!r} (pid {pid}, {self.pool.python}) {what} ({status}).{restart}"
            + (f"\nEnd of the worker's stderr:\n{tail}" if tail else "\nThe worker wrote nothing to stderr.")
        )

    def _request(self, message: tuple[Any, ...], fds: list[int], timeout: float | None) -> tuple[Any, ...]:
        channel = self.channel
        if channel is None:
            raise WorkerError(f"The worker for model {self.pool.name!r} is not running")
        try:
            channel.send(message, fds)
            reply, reply_fds = channel.recv(timeout)
        except TimeoutError:
            raise self._failure(f"did not answer within {timeout:g} s", kill=True) from None
        except ChannelClosed:
            raise self._failure("died") from None
        except DescriptorsLost as e:
            raise self._failure(f"sent shared memory this process could not take: {e}", kill=True) from None
        tag = reply[0]
        if tag == "error":
            for fd in reply_fds:
                os.close(fd)
            raise _worker_exception(reply, self.pool.name)
        if tag == "fatal":
            raise self._failure(reply[1])
        self._reply_fds = reply_fds
        return reply  # type: ignore[no-any-return]

    # -- one call ----------------------------------------------------------------

    def _same_layout(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Copy the inputs into last call's places when names, dtypes and shapes are all the same.

        The common case of a model called again and again: one copy per
        input (none for the same arrays from empty()), and the worker reuses
        its views (the request says "same").
        """
        layout = self.layout
        if layout is None or len(layout) != len(inputs):
            return False
        # One pass that checks and copies: a mismatch half-way only wastes copies the slow path redoes.
        for (name, dtype, shape, view), (given, arr) in zip(layout, inputs.items()):
            if given != name or arr.dtype is not dtype or arr.shape != shape:
                return False
            if view is not None:
                view[...] = arr
            elif self.layout_handed[name]() is not arr:
                return False
        return True

    def _handed_drops(self) -> list[int]:
        """Blocks from empty() this worker maps but nobody holds any more: the worker can unmap them."""
        pool = self.pool
        with pool.lock:
            gen = pool.handed_gen
            live = {h.block.id for h in pool.handed.values()}
        gone = self.known_handed - live
        self.known_handed -= gone
        self.handed_gen = gen
        return sorted(gone)

    def infer(
        self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        pool = self.pool
        leases = self.out_leases
        # Request parameters ride at the end of the message, only when there are some.
        extra: tuple[Any, ...] = () if parameters is None else (dict(parameters),)
        free = [b for b in self.out_blocks if (ref := leases.get(b)) is None or ref() is None]
        wanted = None if requested is None else tuple(requested)
        drops = self.drops
        if self.handed_gen != pool.handed_gen:
            drops = drops + self._handed_drops()
        if self._same_layout(inputs):
            self.drops = []
            return self._finish(self._request(("infer", None, wanted, (), free, drops, *extra), [], pool.timeout))
        # Where each input goes: (name, array or encoded strings, dtype text, shape, offset or handed block).
        plan: list[tuple[str, Any, str, tuple[int, ...], int, _Handed | None]] = []
        total = 0
        handed = pool.handed
        for name, arr in inputs.items():
            if arr.dtype.kind in "UOS":
                encoded = string_bytes(arr)
                if encoded is None:  # the spec check lets only str through; this is a last guard
                    raise WorkerError(f"Input {name!r} of model {pool.name!r} holds something other than str")
                plan.append((name, encoded[1], encoded[0], arr.shape, total, None))
                total += aligned(string_size(encoded[1]))
                continue
            base: Any = arr.base
            if base is not None and handed:
                h = handed.get(id(base))
                if h is not None and h.ref() is base and (h.arr() is arr or arr.ctypes.data == h.block.address):
                    plan.append((name, arr, arr.dtype.str, arr.shape, 0, h))  # made by empty(): no copy
                    continue
            plan.append((name, arr, arr.dtype.str, arr.shape, total, None))
            total += aligned(arr.nbytes)
        new: list[tuple[int, int]] = []
        fds: list[int] = []
        own_fds: list[int] = []
        arena = self.arena
        try:
            copied = any(entry[5] is None for entry in plan)
            if copied and (arena is None or arena.size < total):
                # Grown by at least half again, so inputs that grow a little each call do not make a block each time.
                arena, fd = Block.create(pool.new_block_id(), max(total, (arena.size * 3 // 2) if arena else 0))
                if self.arena is not None:
                    drops = [*drops, self.arena.id]
                self.arena = arena
                new.append((arena.id, arena.size))
                fds.append(fd)
                own_fds.append(fd)
            sent = []
            layout: list[_Place] | None = []
            for name, value, dt, shape, offset, h in plan:
                if h is not None:
                    if h.block.id not in self.known_handed:
                        new.append((h.block.id, h.block.size))
                        fds.append(h.fd)
                        self.known_handed.add(h.block.id)
                    sent.append((name, h.block.id, 0, dt, shape))
                    if layout is not None:
                        layout.append((name, value.dtype, shape, None))
                        self.layout_handed[name] = weakref.ref(value)
                    continue
                assert arena is not None
                if dt in STRING_KINDS:
                    put_strings(arena.whole, offset, value)
                    layout = None  # strings are encoded anew on each call
                else:
                    view = np.ndarray(shape, value.dtype, buffer=arena.whole, offset=offset)
                    np.copyto(view, value)
                    if layout is not None:
                        layout.append((name, value.dtype, shape, view))
                sent.append((name, arena.id if arena is not None else 0, offset, dt, shape))
            self.drops = []
            self.layout = None
            reply = self._request(("infer", sent, wanted, new, free, drops, *extra), fds, pool.timeout)
            self.layout = layout
        finally:
            for fd in own_fds:
                os.close(fd)
        return self._finish(reply)

    def _new_out_blocks(self, created: list[tuple[int, int]], dropped: list[int]) -> None:
        fds, self._reply_fds = self._reply_fds, []
        try:
            for i, ((block_id, size), fd) in enumerate(zip(created, fds)):
                fds[i] = -1
                self.out_blocks[block_id] = Block.attach(block_id, fd, size)
        except WorkerError as e:
            raise self._failure(f"sent an output block this process could not map ({e})", kill=True) from None
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        for block_id in dropped:
            self.out_blocks.pop(block_id, None)
            self.out_leases.pop(block_id, None)

    def _finish(self, reply: tuple[Any, ...]) -> dict[str, np.ndarray]:
        _, outputs, created, dropped, *ran = reply
        if ran:  # a worker of another environment's older core sends none
            pool = self.pool
            pool.runs += 1  # unlocked: a count for reports, which concurrent calls may rarely undercount
            pool.run_s += ran[0]
        if created or dropped:
            self._new_out_blocks(created, dropped)
        result = {}
        lease = None
        for name, block_id, offset, dt, shape in outputs:
            block = self.out_blocks[block_id]
            if dt in STRING_KINDS:
                result[name] = get_strings(block.whole, offset, dt, tuple(shape))  # copied out: holds no block
                continue
            if lease is None:
                # One fresh base per call: the block is free again once every array cut from it is gone.
                lease = block.fresh()
                self.out_leases[block_id] = weakref.ref(lease)
            result[name] = np.ndarray(tuple(shape), dtype_of(dt), buffer=lease, offset=offset)
        return result


class _Pool:
    """The workers of one model, handing each call to an idle one."""

    def __init__(
        self, name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
        workers: int, restart: bool, timeout: float | None, gpu_uuid: str | None, package: Package | None,
    ):  # fmt: skip
        self.name = name
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
        self.handed: dict[int, _Handed] = {}
        self.handed_gen = 0
        self.forgotten: queue.SimpleQueue[_Handed] = queue.SimpleQueue()
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
        self.fingerprint = _fingerprint(package_root, package) if restart else None
        #: Calls the workers answered, and the seconds their backend spent in ``infer`` for them.
        self.runs = 0
        self.run_s = 0.0
        self.workers = [_Worker(self) for _ in range(workers)]
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        try:
            for w in self.workers:
                w.start()
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
        self._check_usable()
        if not self.forgotten.empty():
            self._collect()
        worker = self.idle.get()
        try:
            if self.closed:  # while this call waited for a worker
                raise NeuropodError(f"Model {self.name!r} is closed")
            if worker.failed:
                if not self.restart:
                    raise WorkerError(
                        f"The worker for model {self.name!r} has stopped: {worker.reason}. "
                        "Load the model again, or pass restart=True to start a new worker after a failure."
                    )
                worker.restart()
            elif not worker.alive:  # died between calls: say so now, restart (if allowed) on the next call
                raise worker._failure("died")
            if parameters is None:
                return worker.infer(inputs, requested)
            return worker.infer(inputs, requested, parameters)
        finally:
            if self.closed and self._own():
                worker._teardown()
            self.idle.put(worker)

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
        handed = _Handed(block, fd, whole, arr)
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
        while True:
            try:
                idle.append(self.idle.get_nowait())
            except queue.Empty:
                break
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
        for w in idle:
            self.idle.put(w)  # a call that passed the closed check before close() must not wait forever
        with self.lock:
            handed, self.handed = list(self.handed.values()), {}
        for h in handed:
            os.close(h.fd)  # the arrays keep their mapping; only resending them needed the descriptor

    def forget_after_fork(self) -> None:
        for w in self.workers:
            w.forget_after_fork()


def _fingerprint(package_root: str, package: Package | None) -> _Fingerprint:
    if package is None:
        from neuropod.package import read_package

        # Without the Package the client checked, the package on disk now is the nearest to it.
        package = read_package(package_root, verify=False)
    return _Fingerprint(package)


def _worker_exception(reply: tuple[Any, ...], model: str) -> NeuropodError:
    _, cls_name, message, tb = reply
    cls = getattr(errors, cls_name, None)
    if isinstance(cls, type) and issubclass(cls, NeuropodError):
        exc = cls(message)
    else:
        exc = errors.BackendError(f"The worker for model {model!r} failed: {cls_name}: {message}\nWorker traceback:\n{tb}")
    exc.worker_traceback = tb  # type: ignore[attr-defined]
    return exc


def _check_start_args(workers: object, restart: object, timeout: object) -> None:
    check_workers(workers)
    check_flag("restart", restart)
    check_seconds("timeout", timeout)


def start_pool(
    name: str, python: str, package_root: str, backend_id: str, device: str, options: Mapping[str, Any],
    *, workers: int = 1, restart: bool = False, timeout: float | None = None, gpu_uuid: str | None = None,
    package: Package | None = None,
) -> _Pool:  # fmt: skip
    """Start the worker(s) for one model; each loads it before this returns.

    :param package: the package as the caller read (and verified) it: with
        ``restart=True``, a restart checks the files against its manifest.
        Without it, the manifest on disk is read now.
    :raises TypeError, ValueError: ``workers``, ``restart`` or ``timeout`` is of the wrong type or value.
    """
    _check_start_args(workers, restart, timeout)
    if not sys.platform.startswith("linux"):
        raise NeuropodError("Out-of-process execution needs Linux (memfd shared memory)")
    return _Pool(
        name, python, package_root, backend_id, device, options, int(workers), bool(restart),
        None if timeout is None else float(timeout), gpu_uuid, package,
    )  # fmt: skip


__all__ = ["start_pool"]
