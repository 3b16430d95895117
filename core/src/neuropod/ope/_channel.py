"""The control channel and shared-memory blocks between a model's client and its worker.

Tensors never travel through the channel: they live in shared-memory
*blocks*, anonymous ``memfd`` files that are mapped by both processes. A
block's file descriptor crosses once, as ``SCM_RIGHTS`` ancillary data on the
Unix socket, and is closed right after mapping. A block has no name in any
file system, so nothing can leak: the kernel frees it when both processes
have unmapped it, including when either is killed. (Linux only: memfd_create
and SCM_RIGHTS.)

Messages are ``marshal``-encoded tuples of names, dtypes, shapes and block
ids (fast, and unable to build arbitrary objects), one message per
``SOCK_SEQPACKET`` packet, so no framing is needed.
"""

from __future__ import annotations

import marshal
import mmap
import os
import socket
from typing import Any

import numpy as np

MAX_MESSAGE = 1 << 20
MAX_FDS = 253  # the kernel's SCM_MAX_FD


class ChannelClosed(Exception):
    """The other side has gone away."""


class Channel:
    """One end of a SOCK_SEQPACKET socket pair carrying marshal messages and file descriptors."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """A channel for this process and the socket to hand to the other one."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(ours), theirs

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        data = marshal.dumps(message)
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"control message of {len(data)} bytes is too large")
        try:
            for start in range(0, len(fds or ()), MAX_FDS):  # more fds than one packet carries: send them first
                chunk = fds[start : start + MAX_FDS]  # type: ignore[index]
                if start + MAX_FDS < len(fds):  # type: ignore[arg-type]
                    socket.send_fds(self.sock, [marshal.dumps(("fds",))], chunk)
                else:
                    socket.send_fds(self.sock, [data], chunk)
                    return
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from None

    def recv(self) -> tuple[Any, list[int]]:
        fds: list[int] = []
        while True:
            try:
                data, received, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
            except TimeoutError:
                for fd in fds:
                    os.close(fd)
                raise
            except (ConnectionResetError, OSError) as e:
                for fd in fds:
                    os.close(fd)
                raise ChannelClosed(str(e)) from None
            if not data:
                for fd in fds + list(received):
                    os.close(fd)
                raise ChannelClosed("the other process closed the channel")
            fds.extend(received)
            message = marshal.loads(data)
            if message != ("fds",):
                return message, fds

    def close(self) -> None:
        self.sock.close()


class Block:
    """A shared-memory block: an anonymous memfd mapped into this process."""

    __slots__ = ("address", "id", "mm", "size")

    def __init__(self, block_id: int, mm: mmap.mmap, size: int):
        self.id = block_id
        self.mm = mm
        self.size = size
        # The address of the mapping, to recognise arrays that already live here.
        self.address = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data

    @classmethod
    def create(cls, block_id: int, size: int) -> tuple[Block, int]:
        """A new block and its file descriptor (to send to the other process, then close)."""
        size = max(size, 1)
        fd = os.memfd_create(f"neuropod-{block_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(block_id, mm, size), fd

    @classmethod
    def attach(cls, block_id: int, fd: int, size: int) -> Block:
        """Map a block whose descriptor came from the other process; the descriptor is closed."""
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(block_id, mm, size)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the start of this block."""
        view: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=self.mm)
        return view


def dtype_of(text: str) -> np.dtype[Any]:
    """A dtype from its ``.str`` form; only plain numeric, bool and unicode dtypes may cross."""
    dtype = np.dtype(text)
    if dtype.kind not in "biufU":
        raise ValueError(f"dtype {text!r} cannot cross to or from a worker")
    return dtype
