"""The control channel and shared-memory blocks between a model's client and its worker.

Tensors never travel through the channel: they live in shared-memory
*blocks*, anonymous ``memfd`` files that are mapped by both processes. A
block's file descriptor crosses once, as ``SCM_RIGHTS`` ancillary data on the
Unix socket, and is closed right after mapping. A block has no name in any
file system, so nothing can leak: the kernel frees it when both processes
have unmapped it, including when either is killed. (Linux only: memfd_create
and SCM_RIGHTS.)

Messages are length-prefixed ``marshal``-encoded tuples of names, dtypes,
shapes and block ids (fast, and unable to build arbitrary objects) over a
pair of pipes.
"""

from __future__ import annotations

import marshal
import mmap
import os
import select
import socket
import struct
import time
from typing import Any

import numpy as np

MAX_MESSAGE = 1 << 24
MAX_FDS = 253  # the kernel's SCM_MAX_FD
PROTOCOL = 1  # bumped whenever messages change: a worker from another core refuses to serve
_LENGTH = struct.Struct("<I")
#: How long a reader polls before it sleeps (NEUROPOD_OPE_SPIN_US overrides; 0 never polls).
SPIN_SECONDS = float(os.environ.get("NEUROPOD_OPE_SPIN_US", "1000")) * 1e-6


class ChannelClosed(Exception):
    """The other side has gone away."""


class Channel:
    """Messages over a pair of pipes; file descriptors over a Unix socket, only when blocks are new.

    Pipes carry every call (a round trip costs a few microseconds here, a
    Unix socket's tens), and the socket carries descriptors with SCM_RIGHTS,
    which only happens when a block is created.
    """

    def __init__(self, read_fd: int, write_fd: int, fd_sock: socket.socket, timeout: float | None = None):
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.fd_sock = fd_sock
        self.timeout = timeout
        self.spin = SPIN_SECONDS
        os.set_blocking(read_fd, False)  # reads poll (see _spin), then wait in select

    @classmethod
    def pair(cls) -> tuple[Channel, tuple[int, int, socket.socket]]:
        """A channel for this process, and (read fd, write fd, socket) for the other one."""
        to_them_r, to_them_w = os.pipe()
        to_us_r, to_us_w = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(to_us_r, to_them_w, ours), (to_them_r, to_us_w, theirs)

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        data = marshal.dumps((len(fds or ()), message))
        try:
            for start in range(0, len(fds or ()), MAX_FDS):
                socket.send_fds(self.fd_sock, [b"f"], fds[start : start + MAX_FDS])  # type: ignore[index]
            view = memoryview(_LENGTH.pack(len(data)) + data)
            while view:
                view = view[os.write(self.write_fd, view) :]
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from None

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self._spin(left)
            if chunk is None:
                ready, _, _ = select.select([self.read_fd], [], [], self.timeout)
                if not ready:
                    raise TimeoutError(f"no answer within {self.timeout} s")
                try:
                    chunk = os.read(self.read_fd, left)
                except BlockingIOError:
                    continue
                except OSError as e:
                    raise ChannelClosed(str(e)) from None
            if not chunk:
                raise ChannelClosed("the other process closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _spin(self, n: int) -> bytes | None:
        """Poll the pipe for a short while before sleeping in select.

        Waking a process that sleeps in select costs tens to over a hundred
        microseconds on small VMs (about 150 us on this project's 2-core
        development VM), more than a small model's whole call. A request or
        answer that comes within the window (1 ms by default; set
        NEUROPOD_OPE_SPIN_US, 0 to never poll) is picked up without that
        cost, at the price of up to that much CPU time after each call on
        each side.
        """
        deadline = time.perf_counter() + self.spin
        fd = self.read_fd
        while True:
            try:
                return os.read(fd, n)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return None
            except OSError as e:
                raise ChannelClosed(str(e)) from None

    def recv(self) -> tuple[Any, list[int]]:
        (size,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if size > MAX_MESSAGE:
            raise ChannelClosed(f"a control message of {size} bytes is not one of ours")
        count, message = marshal.loads(self._read(size))
        fds: list[int] = []
        while len(fds) < count:
            try:
                _, received, _, _ = socket.recv_fds(self.fd_sock, 16, MAX_FDS)
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                raise ChannelClosed(str(e)) from None
            if not received:
                raise ChannelClosed("the other process closed the channel")
            fds.extend(received)
        return message, fds

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self.write_fd = -1
        self.fd_sock.close()


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
