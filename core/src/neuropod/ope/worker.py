"""The worker process: ``python -m neuropod.ope.worker READ_FD WRITE_FD SOCKET_FD PARENT_PID LIFELINE_FD``.

It loads one model with this environment's plugin and answers requests on
the channel (two pipes and a socket for descriptors) until it closes (the client closed
the model, or died), then exits.

Its life is tied to the client *process* by a lifeline: the read end of a
pipe whose only write end the client holds. The worker asks the kernel
(``O_ASYNC`` with ``F_SETSIG``) to send it SIGKILL when that pipe hangs up,
which happens when the client process exits or is killed, even while the
worker is busy in native code. (``PR_SET_PDEATHSIG`` is not used: it fires
when the *thread* that started the worker ends, and a model loaded from a
thread pool must outlive that thread.)

Inputs are numpy views over the client's input block (strings decoded into
the same kind of array the client passed); outputs are copied once into one
block per call that the client maps, reused while the client has no array
over it.

Requests: ``"load"``, ``"infer"``; for a decoupled model ``"stream"`` (the
inputs, as ``"infer"``: opens the model's generator and answers with its
first response), ``"next"`` (the next response) and ``"cancel"`` (closes the
generator). A response is an ``"item"`` (laid out as an ``"ok"`` answer), or
``"end"``; an error ends the stream (the generator is closed first).

A stateful model's worker keeps the state of the sequences its client pins to it (see
:mod:`neuropod.ope.sequences`): ``"sequences"`` (after ``"load"``: the state pairs and controls
the client loaded the model with) builds its :class:`~neuropod.sequences.SequenceTable`;
``"steps"`` (the caller's inputs, as ``"infer"``, with the steps ``(id, start, end, rows)`` and
the ids of sequences to free first) runs one step of each, taking and keeping their state here,
and answers with the caller's outputs only; ``"end"`` frees sequences, ``"state"`` copies one's
state out, ``"live"`` counts them. Limits (idle time, live sequences) are the client's to keep.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

from neuropod import plugins
from neuropod._version import __version__
from neuropod.errors import BackendError, NeuropodError, NoBackendError, SpecError, WorkerError
from neuropod.ope._channel import (
    PROTOCOL,
    STRING_KINDS,
    Block,
    Channel,
    ChannelClosed,
    DescriptorsLost,
    aligned,
    get_tensors,
    put_strings,
    string_bytes,
    string_size,
)
from neuropod.package import Package, read_package
from neuropod.sequences import NOT_FAST, SequenceStep, SequenceTable
from neuropod.stateful import build_table, run_steps, with_sequences
from neuropod.streams import cannot_stream

_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux's value; the fcntl module names it from Python 3.12 on


def _die_with_parent(parent_pid: int, lifeline: int) -> None:
    """Have the kernel kill this worker the moment the client process is gone, even mid-inference."""
    fcntl.fcntl(lifeline, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(lifeline, _F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(lifeline, fcntl.F_SETFL, fcntl.fcntl(lifeline, fcntl.F_GETFL) | os.O_ASYNC | os.O_NONBLOCK)
    # The client may have gone before the signal was armed: then the pipe has already hung up.
    ready, _, _ = select.select([lifeline], [], [], 0)
    if ready or os.getppid() != parent_pid:
        os._exit(0)


class _Fatal(Exception):
    """The worker and its client are out of step (a block did not arrive): it answers once more and exits."""


class Worker:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.in_blocks: dict[int, Block] = {}
        self.out_blocks: dict[int, Block] = {}
        self.next_block = 1
        self.last_inputs: dict[str, np.ndarray] = {}
        self.name = "?"
        self.model: Any = None
        self.infer: Any = None
        self.infer_with_parameters: Any = None
        #: The backend's ``infer_stream`` (a decoupled model), and the open stream's iterator.
        self.infer_stream: Any = None
        self.stream: Any = None
        self.stream_wanted: list[str] | None = None
        self.backend_id = "?"
        self.package: Package | None = None
        #: A stateful model's live sequences and their state (see :meth:`set_sequences`).
        self.table: SequenceTable | None = None

    def load(self, protocol: int, package_path: str, backend_id: str, device: str, options: dict[str, Any]) -> tuple[Any, ...]:
        if protocol != PROTOCOL:
            raise WorkerError(
                f"This worker ({sys.executable}, neuropod {__version__}) speaks protocol {PROTOCOL}, the client "
                f"{protocol}: recreate the environment with the same neuropod (neuropod env create ... --replace)"
            )
        package = self.package = read_package(package_path, verify=False)  # the client verified it
        self.name = package.name
        found = [b for b in plugins.installed_backends() if b.id == backend_id]
        if not found:
            have = ", ".join(b.id for b in plugins.installed_backends()) or "none"
            raise NoBackendError(f"The worker's environment ({sys.executable}) has no backend {backend_id}; it has: {have}")
        backend = found[0]
        self.backend_id = backend.id
        if package.config.decoupled:
            try:
                self.infer_stream = plugins.stream_caller(plugins.bound_hook("infer_stream", backend))
            except NoBackendError:
                raise cannot_stream(package.name, backend) from None
        handle = plugins.bound_hook("load_model", backend)(
            package=package, backend=backend, device=device, options=options
        )
        infer = plugins.bound_hook("infer", backend)
        self.model = handle
        self.infer = plugins.infer_caller(infer)
        self.infer_with_parameters = plugins.parameters_caller(infer)
        return ("ready", os.getpid(), backend.id, sys.executable)

    def run(self, message: tuple[Any, ...], fds: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        _, _, requested, _, free, _, *extra = message
        parameters = extra[0] if extra else None
        arrays = self._inputs(message, fds)
        wanted = list(requested) if requested is not None else None
        started = time.perf_counter()
        if parameters and self.infer_with_parameters is not None:
            outputs = self.infer_with_parameters(self.model, arrays, wanted, parameters)
        else:
            outputs = self.infer(self.model, arrays, wanted)
        ran = time.perf_counter() - started
        reply, out_fds = self._reply(outputs, free)
        # The backend's own time last: the client tells it from the round trip (WorkerModel.worker_run_time).
        return (*reply, ran), out_fds

    # -- a stateful model's sequences ---------------------------------------------------------

    def set_sequences(self, declared: str) -> tuple[Any, ...]:
        """Make the model stateful with the client's state pairs and controls (JSON: the package's
        own, or those it was loaded with), checked against its specs as a package's are."""
        package = self.package
        if package is None:
            raise WorkerError("This worker has not loaded its model")
        self.package = with_sequences(package, declared, given="of its client")
        config = self.package.config
        self.table = build_table(package.name, config, package.root, config.input_spec, config.output_spec)
        return ("ok",)

    def _table(self) -> SequenceTable:
        if self.table is None:
            raise WorkerError(f"Model {self.name!r} is not stateful in this worker")
        return self.table

    def run_steps(self, message: tuple[Any, ...], fds: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        """One step of each sequence of a ``"steps"`` request, as a model in the client's process
        runs them (:meth:`~neuropod.model.NeuropodModel._run_steps`): their state in, the new
        state kept here (dropped at a sequence's end; as it was when the run fails), the
        controls filled; only the caller's outputs go back."""
        _, _, requested, _, free, _, parameters, steps, ended = message
        arrays = self._inputs(message, fds)
        table = self._table()
        for sequence_id in ended:
            table.end(sequence_id)
        started = time.perf_counter()
        outputs: Any = NOT_FAST
        if len(steps) == 1 and requested is None and not parameters and not steps[0][1]:
            # A live sequence's next step (see SequenceTable.run_one); NOT_FAST when it is not one.
            outputs = table.run_one(steps[0][0], steps[0][2], arrays, self._run_detached, self.model, False)
        if outputs is NOT_FAST:
            outputs = self._general_steps(table, arrays, requested, [SequenceStep(*s) for s in steps], parameters)
        ran = time.perf_counter() - started
        reply, out_fds = self._reply(outputs, free)
        return (*reply, ran), out_fds

    def _general_steps(
        self, table: SequenceTable, arrays: dict[str, np.ndarray], requested: Any, steps: list[SequenceStep],
        parameters: Any,
    ) -> dict[str, Any]:  # fmt: skip
        def call(full: dict[str, Any], wanted: list[str] | None) -> Any:
            if parameters and self.infer_with_parameters is not None:
                return self._detached(self.infer_with_parameters(self.model, full, wanted, parameters))
            return self._run_detached(self.model, full, wanted)

        return run_steps(table, arrays, requested, steps, call, self.backend_id)

    def _run_detached(self, model: Any, inputs: dict[str, Any], wanted: Any) -> Any:
        return self._detached(self.infer(model, inputs, wanted))

    def _detached(self, outputs: Any) -> Any:
        """The model's outputs, with a copy of any that is a view of the client's input blocks
        (a model that hands an input back): the client refills those blocks on its next call,
        and a state must not change under its sequence."""
        if type(outputs) is not dict:
            return outputs
        for name, value in outputs.items():
            # A view of an input is an array whose base (numpy's, or its base's) is a block's whole:
            # cheaper to find than the address of every output (a framework's is a capsule's).
            base = value.base if type(value) is np.ndarray else None
            while type(base) is np.ndarray:
                if any(base is b.whole for b in self.in_blocks.values()):
                    outputs[name] = value.copy()
                    break
                base = base.base
        return outputs

    def sequence_state(self, sequence_id: Any, free: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        """A copy of a live sequence's state, laid out as an ``"ok"`` answer."""
        return self._reply(self._table().state(sequence_id), free)

    def end_sequences(self, ids: list[Any]) -> int:
        table = self._table()
        return sum(1 for sequence_id in ids if table.end(sequence_id))

    def open_stream(self, message: tuple[Any, ...], fds: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        """Start a decoupled model's stream on the inputs (``"stream"``): its first response."""
        self.end_stream()  # the client does not open a stream over another, but a stale one must not linger
        _, _, requested, _, free, _, *extra = message
        arrays = self._inputs(message, fds)
        if self.infer_stream is None:
            raise NeuropodError(f"Model {self.name!r} is not decoupled: it answers with infer, not infer_stream")
        wanted = self.stream_wanted = list(requested) if requested is not None else None
        self.stream = self.infer_stream(self.model, arrays, wanted, extra[0] if extra else None)
        if self.stream is None or isinstance(self.stream, Mapping) or not hasattr(self.stream, "__next__"):
            got, self.stream = type(self.stream).__name__, None
            raise BackendError(
                f"Backend {self.backend_id} returned {got} from infer_stream for decoupled model {self.name!r}, "
                "not an iterator of responses"
            )
        return self.next_response(free)

    def next_response(self, free: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        """The open stream's next response (``"item"``, like an ``"ok"`` reply) or its end (``"end"``).
        An error ends the stream (the generator is closed) before it goes back to the client."""
        stream = self.stream
        if stream is None:
            return ("end",), []
        try:
            outputs = next(stream)
            if not isinstance(outputs, Mapping):
                raise BackendError(
                    f"Backend {self.backend_id} gave a response of {type(outputs).__name__} for model "
                    f"{self.name!r}, not a dict of output name to numpy array"
                )
            wanted = self.stream_wanted
            if wanted is not None:  # only what the client keeps crosses
                outputs = {name: outputs[name] for name in wanted if name in outputs}
            reply, out_fds = self._reply(outputs, free)
        except StopIteration:
            self.stream = None
            return ("end",), []
        except BaseException:
            self.end_stream()
            raise
        return ("item", *reply[1:]), out_fds

    def end_stream(self) -> None:
        """Close the open stream's iterator (a generator's ``finally`` runs), if there is one."""
        stream, self.stream = self.stream, None
        closer = getattr(stream, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:  # noqa: BLE001 - a finally that raises: the stream is over either way
                traceback.print_exc()

    def _inputs(self, message: tuple[Any, ...], fds: list[int]) -> dict[str, np.ndarray]:
        """A request's inputs as arrays over the client's blocks (mapping the new ones, dropping the gone)."""
        _, inputs, _, new_blocks, _, drop, *_ = message
        for block_id in drop:  # views over them in last_inputs keep their mapping until replaced
            self.in_blocks.pop(block_id, None)
        try:
            for i, ((block_id, size), fd) in enumerate(zip(new_blocks, fds)):
                fds[i] = -1  # attach closes it, mapped or not
                self.in_blocks[block_id] = Block.attach(block_id, fd, size)
        except WorkerError as e:
            raise _Fatal(f"could not map the client's shared memory: {e}") from None
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        if self.infer is None:
            raise WorkerError("This worker has not loaded its model")
        if inputs is None:  # the client refilled last call's places in its block: same views
            arrays = self.last_inputs
        else:
            arrays = get_tensors(self.in_blocks, inputs, copy=False)
            self.last_inputs = arrays
        return arrays

    def _reply(self, outputs: Any, free: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        """Copy the outputs into one block (a free one that fits, else a new one) and describe them."""
        if not isinstance(outputs, dict):
            outputs = dict(outputs)  # a Mapping; anything else fails here as it would in-process
        placed: list[tuple[str, np.ndarray | list[bytes], str, tuple[int, ...], int]] = []
        total = 0
        for name, value in outputs.items():
            arr = np.asarray(value)
            if arr.dtype.kind in "UOS":
                encoded = string_bytes(arr)
                if encoded is None:
                    kinds = sorted({type(v).__name__ for v in arr.flat if not isinstance(v, (str, bytes))})
                    raise SpecError(
                        f"Tensor {name!r} in the output spec of model {self.name!r}: string tensors hold str, "
                        f"but the backend returned an object array holding {', '.join(kinds)}"
                    )
                kind, parts = encoded
                placed.append((name, parts, kind, arr.shape, total))
                total += aligned(string_size(parts))
            else:
                if arr.dtype.kind not in "biuf":
                    raise SpecError(
                        f"Model {self.name!r} returned {name!r} as {arr.dtype}: only numeric, bool and string "
                        "tensors can cross from a worker"
                    )
                placed.append((name, arr, arr.dtype.str, arr.shape, total))
                total += aligned(arr.nbytes)
        fits = [self.out_blocks[b] for b in free if b in self.out_blocks and self.out_blocks[b].size >= total]
        created, out_fds, dropped = [], [], []
        if fits:
            block = min(fits, key=lambda b: b.size)
        else:
            block, fd = Block.create(self.next_block, total)
            self.next_block += 1
            self.out_blocks[block.id] = block
            created.append((block.id, block.size))
            out_fds.append(fd)
            # Free blocks too small for this call go: the client holds nothing over them.
            for b in free:
                if b in self.out_blocks and self.out_blocks[b].size < total:
                    del self.out_blocks[b]
                    dropped.append(b)
        whole = block.whole
        reply = []
        for name, value, dt, shape, offset in placed:
            if dt in STRING_KINDS:
                put_strings(whole, offset, value)  # type: ignore[arg-type]
            else:
                np.copyto(np.ndarray(shape, value.dtype, buffer=whole, offset=offset), value)  # type: ignore[union-attr]
            reply.append((name, block.id, offset, dt, shape))
        return ("ok", reply, created, dropped), out_fds

    def serve(self) -> None:
        while True:
            try:
                message, fds = self.channel.recv()
            except ChannelClosed:
                return
            except DescriptorsLost as e:
                # The client's blocks did not all arrive: this worker cannot serve it any more.
                self._send(("fatal", f"could not receive the client's shared memory: {e}"), [])
                return
            kind = message[0]
            out_fds: list[int] = []
            try:
                if kind == "infer":
                    reply, out_fds = self.run(message, fds)
                elif kind == "steps":
                    reply, out_fds = self.run_steps(message, fds)
                elif kind == "end":
                    reply = ("ended", self.end_sequences(message[1]))
                elif kind == "live":
                    self.end_sequences(message[1])
                    reply = ("live", self._table().live)
                elif kind == "state":
                    reply, out_fds = self.sequence_state(message[1], message[2])
                elif kind == "sequences":
                    reply = self.set_sequences(message[1])
                elif kind == "next":
                    reply, out_fds = self.next_response(message[1])
                elif kind == "stream":
                    reply, out_fds = self.open_stream(message, fds)
                elif kind == "cancel":
                    self.end_stream()
                    reply = ("end",)
                elif kind == "load":
                    reply = self.load(*message[1:])
                else:
                    reply = ("error", "NeuropodError", f"unknown request {kind!r}", "")
            except _Fatal as e:
                self._send(("fatal", str(e)), [])
                return
            except BaseException as e:  # everything goes back to the client, the worker keeps serving
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                reply = ("error", type(e).__name__, str(e)[:20000], traceback.format_exc()[-20000:])
            if not self._send(reply, out_fds):
                return

    def _send(self, reply: tuple[Any, ...], fds: list[int]) -> bool:
        try:
            self.channel.send(reply, fds)
            return True
        except ChannelClosed:
            return False
        finally:
            for fd in fds:
                os.close(fd)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    read_fd, write_fd, sock_fd, parent_pid, lifeline = (int(a) for a in args[:5])
    for fd in (read_fd, write_fd, sock_fd, lifeline):
        os.set_inheritable(fd, False)  # nothing the model starts may hold them
    _die_with_parent(parent_pid, lifeline)
    faulthandler.enable()  # a crash in native code leaves its Python stack in the stderr the client reports
    channel = Channel(read_fd, write_fd, socket.socket(fileno=sock_fd))
    Worker(channel).serve()


if __name__ == "__main__":
    main()
