"""One worker process, seen from the process that started it: its start, restart and end, and one
call's trip through the shared-memory blocks (:mod:`neuropod.ope._channel`).

The worker's own side is :mod:`neuropod.ope.worker`; the pool that hands calls to idle workers is
:mod:`neuropod.ope.pool`.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod import errors
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
    get_tensors,
    limit_error,
    put_strings,
    string_bytes,
    string_size,
)
from neuropod.sequences import StateMismatchError

if TYPE_CHECKING:
    from neuropod.ope.pool import WorkerPool

_STDERR_TAIL = 4000
#: Seconds a worker whose channel closed gets to finish dying (e.g. a fault handler writing its stack).
_DEATH_WAIT = 5.0
_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN)

_Place = tuple[str, "np.dtype[Any]", tuple[int, ...], "np.ndarray | None"]


class HandedBlock:
    """A block handed to the caller by ``empty()``: inputs over it are not copied."""

    __slots__ = ("arr", "block", "fd", "key", "ref")

    def __init__(self, block: Block, fd: int, whole: np.ndarray, arr: np.ndarray):
        self.block = block
        self.fd = fd  # kept open: each worker (and a restarted one) gets its own copy
        self.key = id(whole)
        self.ref = weakref.ref(whole)  # the base of every array made over it
        self.arr = weakref.ref(arr)  # the array handed out: passed as it is, it needs no address check


class WorkerProcess:
    """One worker process and the blocks it shares with this process."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self.lifeline: Any = None  # our end of the lifeline pipe: closing it kills the worker
        self.stderr: Any = None
        self.failed = False
        self.reason = ""
        self.pid = 0
        self._reply_fds: list[int] = []
        #: Held by a call that names this worker (a stateful model's, whose sequences live here).
        self.lock = threading.Lock()
        #: Counts the processes started: sequences pinned to an earlier one lost their state with it.
        self.generation = 0
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
        #: A stream dropped unread asked the worker to end it: the worker's answer is still to be read.
        self.ending_stream = False
        #: The layout of inputs posted without waiting for the answer (see :meth:`post_steps`).
        self._posted: list[_Place] | None = None

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
        if pool.sequences is not None:  # a stateful model: the worker keeps its sequences' state
            try:
                self._request(("sequences", pool.sequences), [], None)
            except BaseException as e:
                self._teardown()
                self.failed = True
                self.reason = f"it failed to set up the model's sequences: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                raise
        self.generation += 1

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

    def _receive(self, channel: Channel, timeout: float | None, what: str) -> tuple[Any, list[int]]:
        """The worker's next message and the descriptors it sent; a worker that does not ``what``
        within ``timeout``, dies, or sends what cannot be taken is a WorkerError (killed but for death)."""
        try:
            return channel.recv(timeout)
        except TimeoutError:
            raise self._failure(f"did not {what} within {timeout:g} s", kill=True) from None
        except ChannelClosed:
            raise self._failure("died") from None
        except DescriptorsLost as e:
            raise self._failure(f"sent shared memory this process could not take: {e}", kill=True) from None

    def _request(self, message: tuple[Any, ...], fds: list[int], timeout: float | None) -> tuple[Any, ...]:
        self._post(message, fds)
        return self._answer(timeout)

    def _post(self, message: tuple[Any, ...], fds: list[int]) -> None:
        """Send a request; its answer is read by :meth:`_answer`."""
        channel = self.channel
        if channel is None:
            raise WorkerError(f"The worker for model {self.pool.name!r} is not running")
        try:
            channel.send(message, fds)
        except ChannelClosed:
            raise self._failure("died") from None

    def _answer(self, timeout: float | None) -> tuple[Any, ...]:
        """The answer to the request :meth:`_post` sent (an error it carries raised here)."""
        channel = self.channel
        if channel is None:
            raise WorkerError(f"The worker for model {self.pool.name!r} is not running")
        reply, reply_fds = self._receive(channel, timeout, "answer")
        tag = reply[0]
        if tag == "error":
            for fd in reply_fds:
                os.close(fd)
            raise worker_exception(reply, self.pool.name)
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
        return self._finish(self._send("infer", inputs, requested, parameters))

    def _send(
        self, kind: str, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None, tail: tuple[Any, ...] | None = None, wait: bool = True,
    ) -> tuple[Any, ...]:  # fmt: skip
        """Send a request with inputs (``"infer"``, ``"stream"`` to open a stream, ``"steps"`` with
        ``tail``) and return the reply; with ``wait=False`` only send it (:meth:`steps_answer` reads
        the reply) and return ``()``."""
        pool = self.pool
        leases = self.out_leases
        # Request parameters ride at the end of the message, only when there are some; a request
        # with a tail always has them (None for none), then the tail.
        if tail is not None:
            extra: tuple[Any, ...] = (None if parameters is None else dict(parameters), *tail)
        else:
            extra = () if parameters is None else (dict(parameters),)
        free = [b for b in self.out_blocks if (ref := leases.get(b)) is None or ref() is None]
        wanted = None if requested is None else tuple(requested)
        drops = self.drops
        if self.handed_gen != pool.handed_gen:
            drops = drops + self._handed_drops()
        if self._same_layout(inputs):
            self.drops = []
            if not wait:
                self._posted = self.layout
                self._post((kind, None, wanted, (), free, drops, *extra), [])
                return ()
            return self._request((kind, None, wanted, (), free, drops, *extra), [], pool.timeout)
        # Where each input goes: (name, array or encoded strings, dtype text, shape, offset or handed block).
        plan: list[tuple[str, Any, str, tuple[int, ...], int, HandedBlock | None]] = []
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
            if not wait:  # the kernel holds the descriptors once sent: ours close below
                self._post((kind, sent, wanted, new, free, drops, *extra), fds)
                self._posted = layout
                return ()
            reply = self._request((kind, sent, wanted, new, free, drops, *extra), fds, pool.timeout)
            self.layout = layout
        finally:
            for fd in own_fds:
                os.close(fd)
        return reply

    # -- a stateful model's sequences, whose state this worker keeps (see neuropod.ope.sequences) --

    def post_steps(
        self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None, steps: list[tuple[Any, ...]],
        parameters: Mapping[str, Any] | None, ended: list[Any],
    ) -> None:  # fmt: skip
        """Send one step of each of ``steps`` (``(id, start, end, rows)``) on ``inputs``, without
        waiting: :meth:`steps_answer` reads the outputs. ``ended``: sequences to free first."""
        self._send("steps", inputs, requested, parameters, (steps, ended), wait=False)

    def steps_answer(self) -> dict[str, np.ndarray]:
        """The outputs of the steps :meth:`post_steps` sent."""
        layout, self._posted = self._posted, None
        reply = self._answer(self.pool.timeout)
        self.layout = layout
        return self._finish(reply)

    def end_sequences(self, ids: list[Any]) -> int:
        """Free these sequences' state in the worker (unknown ids are skipped); how many it held."""
        return int(self._request(("end", ids), [], self.pool.timeout)[1])

    def live_sequences(self, ended: list[Any]) -> int:
        """How many sequences the worker holds, after freeing ``ended``."""
        return int(self._request(("live", ended), [], self.pool.timeout)[1])

    def sequence_state(self, sequence_id: Any) -> dict[str, np.ndarray]:
        """A copy of a sequence's state, copied out of the worker."""
        leases = self.out_leases
        free = [b for b in self.out_blocks if (ref := leases.get(b)) is None or ref() is None]
        state = self._response(self._request(("state", sequence_id, free), [], self.pool.timeout))
        assert state is not None
        return state

    # -- one stream's responses (see neuropod.ope.streaming) ------------------------

    def open_stream(
        self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None,
        parameters: Mapping[str, Any] | None,
    ) -> dict[str, np.ndarray] | None:  # fmt: skip
        """Open a stream on this worker: the model's first response, or None when it has none."""
        return self._response(self._send("stream", inputs, requested, parameters))

    def next_response(self) -> dict[str, np.ndarray] | None:
        """The open stream's next response, or None at its end."""
        leases = self.out_leases
        free = [b for b in self.out_blocks if (ref := leases.get(b)) is None or ref() is None]
        return self._response(self._request(("next", free), [], self.pool.timeout))

    def cancel_stream(self) -> None:
        """Close the open stream's generator in the worker (its ``finally`` runs) and wait until it has."""
        self._request(("cancel",), [], self.pool.timeout)

    def abandon_stream(self) -> None:
        """Ask the worker to close the open stream's generator, without waiting for its answer (a
        stream dropped unread, from garbage collection): the next call on this worker reads it first."""
        channel = self.channel
        if channel is None:
            return
        try:
            channel.send(("cancel",))
        except ChannelClosed:
            return
        self.ending_stream = True

    def end_abandoned_stream(self) -> None:
        """Read the worker's answer to :meth:`abandon_stream` (before this worker's next call)."""
        self.ending_stream = False
        channel = self.channel
        if channel is None:
            return
        _, fds = self._receive(channel, self.pool.timeout, "end a stream")
        for fd in fds:
            os.close(fd)

    def _response(self, reply: tuple[Any, ...]) -> dict[str, np.ndarray] | None:
        """A stream's reply: None for its end; else the response, copied out of the block, which
        the worker may then reuse for the next response (a stream's responses are often all kept)."""
        if reply[0] == "end":
            return None
        _, outputs, created, dropped = reply
        if created or dropped:
            self._new_out_blocks(created, dropped)
        return get_tensors(self.out_blocks, outputs, copy=True)

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


def worker_exception(reply: tuple[Any, ...], model: str) -> NeuropodError:
    """The error a worker sent back (``("error", class name, message, traceback)``), raised here as its own class."""
    _, cls_name, message, tb = reply
    cls = getattr(errors, cls_name, None) or (StateMismatchError if cls_name == "StateMismatchError" else None)
    if isinstance(cls, type) and issubclass(cls, NeuropodError):
        exc = cls(message)
    else:
        exc = errors.BackendError(f"The worker for model {model!r} failed: {cls_name}: {message}\nWorker traceback:\n{tb}")
    exc.worker_traceback = tb  # type: ignore[attr-defined]
    return exc


__all__ = ["HandedBlock", "WorkerProcess", "worker_exception"]
