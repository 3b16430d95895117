"""The worker process: ``python -m neuropod.ope.worker READ_FD WRITE_FD SOCKET_FD PARENT_PID``.

It loads one model with this environment's plugin and answers requests on
the channel (two pipes and a socket for descriptors) until it closes (the client closed
the model, or died), then exits. Inputs are numpy views over shared-memory
blocks the client filled; outputs are copied once into blocks the client
maps, and reused across calls while the client has no array over them.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import socket
import sys
import traceback
from typing import Any

import numpy as np

from neuropod.ope._channel import PROTOCOL, Block, Channel, ChannelClosed, dtype_of


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this worker when its parent dies, even mid-inference."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the closed channel still ends the worker when it is idle
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


class Worker:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.in_blocks: dict[int, Block] = {}
        self.out_blocks: dict[int, Block] = {}
        # Keyed by the block object: input ids (the client's) and output ids (ours) may coincide.
        self.views: dict[tuple[Block, str, tuple[int, ...]], np.ndarray] = {}
        self.next_block = 1
        self.last_inputs: dict[str, np.ndarray] = {}
        self.model: Any = None
        self.infer: Any = None

    def load(self, protocol: int, package_path: str, backend_id: str, device: str, options: dict[str, Any]) -> tuple[Any, ...]:
        from neuropod import __version__, plugins
        from neuropod.errors import NoBackendError, WorkerError
        from neuropod.package import read_package

        if protocol != PROTOCOL:
            raise WorkerError(
                f"This worker ({sys.executable}, neuropod {__version__}) speaks protocol {PROTOCOL}, the client "
                f"{protocol}: recreate the environment with the same neuropod (neuropod env create ... --replace)"
            )
        package = read_package(package_path, verify=False)  # the client verified it
        found = [b for b in plugins.installed_backends() if b.id == backend_id]
        if not found:
            have = ", ".join(b.id for b in plugins.installed_backends()) or "none"
            raise NoBackendError(f"The worker's environment ({sys.executable}) has no backend {backend_id}; it has: {have}")
        backend = found[0]
        handle = plugins.bound_hook("load_model", backend)(
            package=package, backend=backend, device=device, options=options
        )
        infer = plugins.bound_hook("infer", backend)
        self.model = handle
        self.infer = infer.function  # type: ignore[attr-defined]
        return ("ready", os.getpid(), backend.id, sys.executable)

    def _view(self, block: Block, dtype_text: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (block, dtype_text, shape)
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = block.view(dtype_of(dtype_text), shape)
        return view

    def run(self, message: tuple[Any, ...], fds: list[int]) -> tuple[tuple[Any, ...], list[int]]:
        _, inputs, requested, new_blocks, reusable = message
        for (block_id, size), fd in zip(new_blocks, fds):
            self.in_blocks[block_id] = Block.attach(block_id, fd, size)
        if inputs is None:  # the client refilled last call's blocks: same views
            arrays = self.last_inputs
        else:
            arrays = {name: self._view(self.in_blocks[bid], dt, tuple(shape)) for name, bid, dt, shape in inputs}
            self.last_inputs = arrays
        outputs = self.infer(self.model, arrays, list(requested) if requested is not None else None)
        free = [self.out_blocks[b] for b in reusable if b in self.out_blocks]
        reply, created, out_fds = [], [], []
        for name, value in outputs.items():
            arr = np.asarray(value)
            if arr.dtype.kind in "OS":
                from neuropod.spec import to_string_array

                arr = to_string_array(arr)
            block = next((b for b in free if b.size >= arr.nbytes), None)
            if block is not None:
                free.remove(block)
            else:
                block, fd = Block.create(self.next_block, arr.nbytes)
                self.next_block += 1
                self.out_blocks[block.id] = block
                created.append((block.id, block.size))
                out_fds.append(fd)
            np.copyto(self._view(block, arr.dtype.str, arr.shape), arr)
            reply.append((name, block.id, arr.dtype.str, arr.shape))
        return ("ok", reply, created), out_fds

    def serve(self) -> None:
        while True:
            try:
                message, fds = self.channel.recv()
            except ChannelClosed:
                return
            kind = message[0]
            out_fds: list[int] = []
            try:
                if kind == "infer":
                    reply, out_fds = self.run(message, fds)
                elif kind == "load":
                    reply = self.load(*message[1:])
                elif kind == "drop":
                    for block_id in message[1]:
                        self.out_blocks.pop(block_id, None)
                    live = set(self.in_blocks.values()) | set(self.out_blocks.values())
                    self.views = {k: v for k, v in self.views.items() if k[0] in live}
                    continue
                else:
                    reply = ("error", "NeuropodError", f"unknown request {kind!r}", "")
            except BaseException as e:  # everything goes back to the client, the worker keeps serving
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                reply = ("error", type(e).__name__, str(e)[:20000], traceback.format_exc()[-20000:])
            try:
                self.channel.send(reply, out_fds)
            except ChannelClosed:
                return
            finally:
                for fd in out_fds:
                    os.close(fd)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    read_fd, write_fd, sock_fd, parent_pid = (int(a) for a in args[:4])
    _die_with_parent(parent_pid)
    faulthandler.enable()  # a crash in native code leaves its Python stack in the stderr the client reports
    channel = Channel(read_fd, write_fd, socket.socket(fileno=sock_fd))
    Worker(channel).serve()


if __name__ == "__main__":
    main()
