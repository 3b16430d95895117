"""The control channel and shared-memory blocks between a model's client and its worker.

Tensors never travel through the channel: they live in shared-memory
*blocks*, anonymous ``memfd`` files that are mapped by both processes. A
block's file descriptor crosses once, as ``SCM_RIGHTS`` ancillary data on the
Unix socket, and is closed right after mapping: a mapping holds no file
descriptor (blocks are mapped with ``mmap(2)`` through ctypes, because
Python's ``mmap`` module keeps a duplicate descriptor open for each mapping).
A block has no name in any file system, so nothing can leak: the kernel frees
it when both processes have unmapped it, including when either is killed.
(Linux only: memfd_create and SCM_RIGHTS.)

All the tensors of one call share one block on each side (the client's input
*arena*, grown when a call needs more; one output block per call, reused once
the caller holds no array over it), so a call with hundreds of tensors costs
no more descriptors than a call with one. Numeric tensors are laid out at
64-byte aligned offsets; a string tensor is ``n + 1`` int64 offsets followed
by its elements' UTF-8 bytes (lone surrogates kept with ``surrogatepass``),
so a short string costs its own length and NUL characters cross unchanged.

Messages are length-prefixed ``marshal``-encoded tuples of names, dtypes,
shapes, block ids and offsets (fast, and unable to build arbitrary objects)
over a pair of pipes. When a system limit stops a block (open files, memory)
the error names the limit.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import marshal
import math
import mmap
import os
import resource
import select
import socket
import struct
import time
import weakref
from typing import Any

import numpy as np

from neuropod.errors import WorkerError

MAX_MESSAGE = 1 << 24
MAX_FDS = 253  # the kernel's SCM_MAX_FD
PROTOCOL = 4  # bumped whenever messages change: a worker from another core refuses to serve
_LENGTH = struct.Struct("<I")
#: How long a reader polls before it sleeps (NEUROPOD_OPE_SPIN_US overrides; 0 never polls).
SPIN_SECONDS = float(os.environ.get("NEUROPOD_OPE_SPIN_US", "1000")) * 1e-6
#: Alignment of each tensor inside a block: enough for any dtype and for SIMD loads.
ALIGN = 64
#: The dtype texts of string tensors: how the elements were held (numpy unicode, object array of str, bytes),
#: and "B" for an object array of bytes (a bytes tensor), which comes back as one, trailing NULs and all.
STRING_KINDS = frozenset({"U", "O", "S", "B"})


class ChannelClosed(Exception):
    """The other side has gone away."""


class DescriptorsLost(Exception):
    """Block descriptors sent with a message did not arrive (the receiver hit its open-file limit)."""


class Channel:
    """Messages over a pair of pipes; file descriptors over a Unix socket, only when blocks are new.

    Pipes carry every call (a round trip costs a few microseconds here, a
    Unix socket's tens), and the socket carries descriptors with SCM_RIGHTS,
    which only happens when a block is created.
    """

    def __init__(self, read_fd: int, write_fd: int, fd_sock: socket.socket):
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.fd_sock = fd_sock
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

    def _read(self, n: int, deadline: float | None) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self._spin(left)
            if chunk is None:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self.read_fd], [], [], wait)
                if not ready:
                    raise TimeoutError("no answer in time")
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

    def recv(self, timeout: float | None = None) -> tuple[Any, list[int]]:
        """The next message and the descriptors that came with it.

        :param timeout: seconds for the whole message, None to wait as long as the other side lives.
        :raises TimeoutError: nothing complete came in time.
        :raises ChannelClosed: the other side is gone.
        :raises DescriptorsLost: the kernel dropped descriptors (this process's open-file limit);
            the message itself was read, so the channel stays in step.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        (size,) = _LENGTH.unpack(self._read(_LENGTH.size, deadline))
        if size > MAX_MESSAGE:
            raise ChannelClosed(f"a control message of {size} bytes is not one of ours")
        count, message = marshal.loads(self._read(size, deadline))
        fds: list[int] = []
        truncated = False
        # The sender put its descriptors on the socket before the message on the pipe: they are there.
        for _ in range(-(-count // MAX_FDS)):
            try:
                _, received, flags, _ = socket.recv_fds(self.fd_sock, 16, MAX_FDS)
            except OSError as e:
                _close_all(fds)
                raise ChannelClosed(str(e)) from None
            fds.extend(received)
            truncated = truncated or bool(flags & socket.MSG_CTRUNC)
        if truncated or len(fds) != count:
            _close_all(fds)
            raise DescriptorsLost(
                f"{count - len(fds)} of {count} shared-memory descriptor(s) were dropped by the kernel: "
                f"{open_files_limit()}"
            )
        return message, fds

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self.write_fd = -1
        self.fd_sock.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# --- shared memory ------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _Mapping:
    """One mapping of a block; unmapped when neither the block nor any array over it is left.

    Numpy arrays over it (``np.asarray(mapping)``) keep it alive through
    their ``base``, so memory is never unmapped under an array.
    """

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, size: int):
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1", "version": 3}
        # Not at interpreter exit: arrays still referenced then (module globals) must stay readable.
        weakref.finalize(self, _munmap, address, size).atexit = False


class Block:
    """A shared-memory block: an anonymous memfd mapped into this process."""

    __slots__ = ("address", "id", "mapping", "size", "whole")

    def __init__(self, block_id: int, fd: int, size: int):
        """Map ``size`` bytes of ``fd`` (which stays open: the caller closes it)."""
        address = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            raise limit_error(OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno())), f"map {_size(size)} of shared memory")
        self.id = block_id
        self.size = size
        self.address = address
        self.mapping = _Mapping(address, size)
        #: The whole block as uint8, for laying tensors out in it.
        self.whole: np.ndarray = np.asarray(self.mapping)

    @classmethod
    def create(cls, block_id: int, size: int) -> tuple[Block, int]:
        """A new block and its file descriptor (to send to the other process, then close)."""
        size = -(-max(size, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            fd = os.memfd_create(f"neuropod-{block_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise limit_error(e, f"create a shared-memory block of {_size(size)}") from None
        try:
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                raise limit_error(e, f"size a shared-memory block to {_size(size)}") from None
            # Sealed at its size: neither side can shrink it under the other's mapping (a SIGBUS).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(block_id, fd, size), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, block_id: int, fd: int, size: int) -> Block:
        """Map a block whose descriptor came from the other process; the descriptor is closed."""
        try:
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS or os.fstat(fd).st_size < size:
                raise WorkerError(f"Shared-memory block {block_id} is not sealed at the {size} bytes announced")
            return cls(block_id, fd, size)
        finally:
            os.close(fd)

    def fresh(self) -> np.ndarray:
        """A new uint8 array over the whole block: arrays cut from it keep it, and only it, as their base.

        Holding a weak reference to it tells when every array of one call is gone.
        """
        return np.asarray(self.mapping)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    value, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value /= 1024
        units.pop(0)
    return f"{value:.1f} {units[0]}"


def open_files_limit() -> str:
    """This process's open-file limit, as a reader would look it up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"the limit on open files of process {os.getpid()} (RLIMIT_NOFILE, `ulimit -n`: {soft}, hard limit {hard})"


def limit_error(e: OSError, what: str) -> WorkerError:
    """A WorkerError that says which system limit stopped ``what``."""
    if e.errno == errno.EMFILE:
        why = f"{open_files_limit()} was reached; raise it or hold fewer arrays from model.empty() at once"
    elif e.errno == errno.ENFILE:
        why = "the system-wide limit on open files (fs.file-max) was reached"
    elif e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
        why = ("out of memory for shared memory (free memory, the memory cgroup's limit, or vm.max_map_count "
               "for the number of mappings)")  # fmt: skip
    else:
        why = "the system refused"
    return WorkerError(f"Cannot {what}: {why} ({e.strerror or e})")


# --- layout of tensors in a block ---------------------------------------------------


def string_bytes(arr: np.ndarray) -> tuple[str, list[bytes]] | None:
    """The kind (U, O, S or B) and the encoded elements of a string tensor; None when some element is not a string.

    Elements are str for U and O arrays, bytes for S arrays and object arrays of bytes (B).
    """
    items = arr.ravel().tolist()
    kind = arr.dtype.kind
    if kind == "S":
        return "S", items
    if kind == "U":
        return "U", [s.encode("utf-8", "surrogatepass") for s in items]
    if all(type(s) is str or isinstance(s, str) for s in items):
        return "O", [s.encode("utf-8", "surrogatepass") for s in items]
    if all(isinstance(s, bytes) for s in items):
        return "B", items
    return None


def string_size(parts: list[bytes]) -> int:
    return 8 * (len(parts) + 1) + sum(map(len, parts))


def put_strings(whole: np.ndarray, offset: int, parts: list[bytes]) -> None:
    """Lay out encoded elements at ``offset``: int64 offsets, then the bytes."""
    n = len(parts)
    ends = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, n), out=ends[1:])
    whole[offset : offset + 8 * (n + 1)].view(np.int64)[:] = ends
    start = offset + 8 * (n + 1)
    data = b"".join(parts)
    whole[start : start + len(data)] = np.frombuffer(data, np.uint8)


def get_strings(whole: np.ndarray, offset: int, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A string tensor laid out by :func:`put_strings`, as the kind of array it was (copied out of the block)."""
    n = math.prod(shape)
    if offset < 0 or offset + 8 * (n + 1) > whole.size:
        raise ValueError(f"a string tensor of {n} elements at offset {offset} does not fit its block")
    ends = whole[offset : offset + 8 * (n + 1)].view(np.int64).tolist()
    start = offset + 8 * (n + 1)
    if any(b < a for a, b in itertools.pairwise(ends)) or ends[0] != 0 or start + ends[-1] > whole.size:
        raise ValueError("a string tensor's offsets are not in order or run past its block")
    data = whole[start : start + ends[-1]].tobytes()
    if kind == "S":
        items: list[Any] = [data[a:b] for a, b in itertools.pairwise(ends)]
        return np.array(items, dtype=bytes).reshape(shape) if n else np.zeros(shape, dtype="S1")
    if kind == "B":
        exact = np.empty(n, dtype=object)
        exact[:] = [data[a:b] for a, b in itertools.pairwise(ends)]
        return exact.reshape(shape)
    items = [data[a:b].decode("utf-8", "surrogatepass") for a, b in itertools.pairwise(ends)]
    if kind == "U":
        return np.array(items, dtype=str).reshape(shape) if n else np.zeros(shape, dtype="<U1")
    out = np.empty(n, dtype=object)
    out[:] = items
    return out.reshape(shape)


_DTYPES: dict[str, np.dtype[Any]] = {}


def dtype_of(text: str) -> np.dtype[Any]:
    """A dtype from its ``.str`` form; only plain numeric and bool dtypes may cross as raw memory."""
    dtype = _DTYPES.get(text)
    if dtype is None:
        dtype = np.dtype(text)
        if dtype.kind not in "biuf":
            raise ValueError(f"dtype {text!r} cannot cross to or from a worker")
        _DTYPES[text] = dtype
    return dtype


def get_tensors(blocks: Any, entries: Any, copy: bool) -> dict[str, np.ndarray]:
    """The tensors ``entries`` place in ``blocks`` (each ``(name, block id, offset, dtype .str,
    shape)``; ``blocks[id].whole`` the block's bytes): a string tensor copied out
    (:func:`get_strings`), any other a view of its block, or a copy with ``copy``."""
    result = {}
    for name, block_id, offset, dt, shape in entries:
        whole = blocks[block_id].whole
        if dt in STRING_KINDS:
            result[name] = get_strings(whole, offset, dt, tuple(shape))
        else:
            array = np.ndarray(tuple(shape), dtype_of(dt), buffer=whole, offset=offset)
            result[name] = array.copy() if copy else array
    return result
