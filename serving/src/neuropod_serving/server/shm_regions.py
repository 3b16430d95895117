"""Tensors in shared memory: the server side of Triton's system and CUDA shared-memory extensions.

A client on the same machine creates a shared memory object, registers a
region of it under a name (REST ``POST /v2/systemsharedmemory/region/{name}/register``,
gRPC ``SystemSharedMemoryRegister``), and then names that region in an inference
request's tensor parameters instead of sending the tensor: the server copies the
input out of the region and writes the requested output into it.

- **System regions** are POSIX shared memory objects (``/dev/shm/<key>``), opened
  read/write with ``O_NOFOLLOW`` (a link is refused) and ``O_NONBLOCK`` and checked to
  be a regular file at least ``offset + byte_size`` long at registration. The server
  keeps that one descriptor (closed at unregistration or when the server stops; the
  object itself is the client's and is never unlinked) and copies through it with
  ``pread``/``pwrite``, never through a mapping: a client that shrinks (truncates) the
  object while a request copies through it cannot fault the server (a read through a
  mapping past the object's new end would kill the whole process with SIGBUS). A read
  that comes back short is a 400 naming the region; a write and a truncation exclude
  each other in the kernel, so the output is written whole (the object is then as long
  as the write needs) or the truncation comes first and the request is refused.
- **CUDA regions** are CUDA IPC handles opened with the CUDA runtime library
  (``libcudart``, looked up when the first one is registered, never at import, by
  :mod:`~neuropod_serving.server.cuda_ipc`): only where NVML sees a GPU and the library loads.
- **Inputs are copied** out of the region before the model runs (one memory copy of
  each: the model gets writable arrays of its own, and a client writing to the region
  while the model runs cannot change them under it). Outputs are written after the
  run, each checked to fit the bytes the request gave it.
- **A request holds the regions it names** from decoding to its answer: unregistering
  one meanwhile removes its name at once, and its descriptor is closed when the last such
  request ends.
- **Every bound is checked before memory is touched**: an unknown region, an offset past
  the region's end, a tensor running past it, a byte size that disagrees with the shape,
  an output larger than its place, a segment the client shrank after registering it
  (checked with ``fstat`` before each copy, and by the length each read gets) are each a
  :class:`ProtocolError` (400, INVALID_ARGUMENT) naming the region and the tensor.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import stat
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.datatypes import WIRE_DTYPES, datatype_of
from neuropod_serving.protocol.fields import show
from neuropod_serving.protocol.shm_params import (
    BYTE_SIZE,
    SharedMemoryRequest,
    SharedTensor,
    response_parameters,
)
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor
from neuropod_serving.server.cuda_ipc import cuda_runtime

log = logging.getLogger("neuropod_serving.server")

#: Regions (system and CUDA together) registered at once; one more is refused. Each system
#: region holds one file descriptor.
MAX_REGIONS = 256
#: A region's name is chosen by the client and kept while it is registered.
MAX_NAME_CHARS = 1024
SYSTEM = "system"
CUDA = "cuda"
_KIND_WORDS = {SYSTEM: "system shared memory", CUDA: "CUDA shared memory"}
_SHM_DIR = "/dev/shm"
#: How to enable it, for the refusals of a server that does not take shared memory.
ENABLE_HINT = "start neuropod serve with --allow-client-shm"


def _refused(message: str, status: int = 400) -> ProtocolError:
    return ProtocolError(message, status=status)


class _Region:
    """One registered region; ``users`` requests hold it (see :class:`Lease`)."""

    kind = ""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.users = 0
        self.closing = False

    def describe(self) -> str:
        return f"{_KIND_WORDS[self.kind]} region {self.name!r}"

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, tensor: SharedTensor, kind: str) -> None:
        """Refuse a tensor whose bytes do not lie within the region."""
        if tensor.offset > self.byte_size or (tensor.offset == self.byte_size and tensor.byte_size):
            raise _refused(
                f"{kind} {tensor.name!r}: shared_memory_offset {tensor.offset} is past the end of "
                f"{self.describe()}, which is {self.byte_size} bytes"
            )
        if tensor.offset + tensor.byte_size > self.byte_size:
            raise _refused(
                f"{kind} {tensor.name!r}: {tensor.byte_size} bytes at offset {tensor.offset} run past the end of "
                f"{self.describe()}, which is {self.byte_size} bytes (offset + {BYTE_SIZE} must be at most that)"
            )

    def read(self, offset: int, size: int) -> np.ndarray[Any, Any]:
        """A fresh, writable copy of ``size`` bytes at ``offset`` (checked by :meth:`check`)."""
        raise NotImplementedError

    def write(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        """Copy ``data`` (uint8, C-contiguous) to ``offset`` (checked by the caller)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _SystemRegion(_Region):
    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._end = offset + byte_size  # in the segment: it must stay at least this long
        fd = _open_segment(name, key)
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            os.close(fd)
            raise _refused(f"cannot register system shared memory region {name!r} ({key!r}): {e.strerror or e}") from None
        if self._end > size:
            os.close(fd)
            raise _refused(
                f"cannot register system shared memory region {name!r}: {byte_size} bytes at offset {offset} "
                f"of {key!r} need it to be at least {self._end} bytes, but it is {size}"
            )
        self._fd = fd

    @property
    def closed(self) -> bool:
        """Whether its descriptor was closed (it was unregistered and no request holds it)."""
        return self._fd < 0

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def _shrank(self, size: int) -> ProtocolError:
        return _refused(
            f"{self.describe()} needs {self.key!r} to be at least {self._end} bytes, but the client shrank it "
            f"to {size} since it was registered; register the region again"
        )

    def _check_segment(self) -> None:
        # A shrink before the copy is refused here, with the size it has now; one during a read
        # shows as a short read, and a write re-extends the object rather than fault.
        try:
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise _refused(f"{self.describe()} cannot be used: {e.strerror or e}") from None
        if size < self._end:
            raise self._shrank(size)

    def read(self, offset: int, size: int) -> np.ndarray[Any, Any]:
        self._check_segment()
        out = _aligned_empty(size)
        if size:
            try:
                got = _read_into(self._fd, out, self.offset + offset)
            except OSError as e:
                raise _refused(f"{self.describe()} cannot be read: {e.strerror or e}") from None
            if got < size:
                self._check_segment()  # raises, naming the size it shrank to
                raise self._shrank(self.offset + offset + got)  # shrunk and grown again meanwhile
        return out

    def write(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        self._check_segment()
        if data.nbytes:
            try:
                _write_from(self._fd, data, self.offset + offset)
            except OSError as e:
                raise _refused(f"{self.describe()} cannot be written: {e.strerror or e}") from None

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class _CudaRegion(_Region):
    kind = CUDA

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.device_id = device_id
        self._cuda = cuda_runtime()
        self._ptr = self._cuda.open(name, raw_handle, device_id, byte_size)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def read(self, offset: int, size: int) -> np.ndarray[Any, Any]:
        out = np.empty(size, np.uint8)
        if size:
            self._cuda.copy(self.device_id, out.ctypes.data, self._ptr + offset, size, to_device=False)
        return out

    def write(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        if data.nbytes:
            self._cuda.copy(self.device_id, self._ptr + offset, data.ctypes.data, data.nbytes, to_device=True)

    def close(self) -> None:
        self._cuda.close(self.device_id, self._ptr)


class SharedMemoryRegistry:
    """The regions clients have registered with this server, by name (one namespace for both kinds).

    Thread-safe: REST handlers and gRPC threads register, use and unregister concurrently.

    :param max_regions: regions registered at once; one more is refused.
    """

    def __init__(self, *, max_regions: int = MAX_REGIONS) -> None:
        if max_regions < 1:
            raise ValueError(f"max_regions must be at least 1, not {max_regions}")
        self.max_regions = max_regions
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}

    def __len__(self) -> int:
        return len(self._regions)

    # -- registration ---------------------------------------------------------------

    def register_system(self, name: object, key: object, offset: object, byte_size: object) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the POSIX shared memory object ``key`` as ``name``.

        :raises ProtocolError: a bad argument, a name already registered, too many regions, an
            object that does not exist, cannot be opened, is not a regular file or is too small.
        """
        name = _region_name(name)
        if not isinstance(key, str) or not key:
            raise _refused(f"cannot register system shared memory region {name!r}: 'key' must be the name of "
                           f"a shared memory object (a non-empty string), not {show(key)}")  # fmt: skip
        offset = _count(offset, "offset", name, minimum=0)
        byte_size = _count(byte_size, "byte_size", name, minimum=1)
        with self._lock:
            self._check_free(name)
            self._regions[name] = _SystemRegion(name, key, offset, byte_size)
        log.info("registered system shared memory region %r: %d bytes at offset %d of %r", name, byte_size, offset, key)

    def register_cuda(self, name: object, raw_handle: object, device_id: object, byte_size: object) -> None:
        """Register the CUDA IPC handle ``raw_handle`` (of memory on GPU ``device_id``) as ``name``.

        :raises ProtocolError: a bad argument, a name already registered, too many regions, no
            GPU or CUDA runtime here, or a handle the CUDA runtime cannot open.
        """
        name = _region_name(name)
        if not isinstance(raw_handle, (bytes, bytearray)):
            raise _refused(f"cannot register CUDA shared memory region {name!r}: raw_handle must be bytes")
        device_id = _count(device_id, "device_id", name, minimum=0)
        byte_size = _count(byte_size, "byte_size", name, minimum=1)
        with self._lock:
            self._check_free(name)
            self._regions[name] = _CudaRegion(name, bytes(raw_handle), device_id, byte_size)
        log.info("registered CUDA shared memory region %r: %d bytes on GPU %d", name, byte_size, device_id)

    def _check_free(self, name: str) -> None:
        known = self._regions.get(name)
        if known is not None:
            raise _refused(
                f"a shared memory region named {name!r} is already registered ({known.describe()}, "
                f"{known.byte_size} bytes); unregister it first or choose another name"
            )
        if len(self._regions) >= self.max_regions:
            raise _refused(
                f"cannot register shared memory region {name!r}: {len(self._regions)} regions are registered, "
                f"the most this server keeps ({self.max_regions}); unregister some first"
            )

    def status(self, kind: str, name: str = "") -> list[dict[str, Any]]:
        """Triton's status of the ``kind`` regions (all of them, or the one named).

        :raises ProtocolError: (404) no region of that kind has that name.
        """
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values() if r.kind == kind]
            region = self._regions.get(name)
        if region is None:
            raise _refused(f"no {_KIND_WORDS[kind]} region named {name!r} is registered", 404)
        if region.kind != kind:
            raise _refused(f"the region named {name!r} is registered as {_KIND_WORDS[region.kind]}, "
                           f"not {_KIND_WORDS[kind]}", 404)  # fmt: skip
        return [region.status()]

    def unregister(self, kind: str, name: str = "") -> None:
        """Unregister the ``kind`` region named ``name`` (every one of that kind when empty). A name
        that is not registered (as that kind) is no error, as in Triton. A region that requests
        still use is closed when the last of them ends."""
        with self._lock:
            names = [n for n, r in self._regions.items() if r.kind == kind and (not name or n == name)]
            regions = [self._regions.pop(n) for n in names]
            for region in regions:
                region.closing = True
            idle = [r for r in regions if r.users == 0]
        for region in idle:
            region.close()
        for n in names:
            log.info("unregistered %s region %r", _KIND_WORDS[kind], n)

    def close(self) -> None:
        """Unregister every region (the server stops)."""
        self.unregister(SYSTEM)
        self.unregister(CUDA)

    # -- requests -------------------------------------------------------------------

    def lease(self, request: SharedMemoryRequest) -> Lease:
        """Hold the regions ``request`` names and check each tensor's bounds in its region.

        :raises ProtocolError: an unknown region, or a tensor not within its region.
        """
        return Lease(self, request)

    def _acquire(self, name: str, tensor: str, kind: str) -> _Region:
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise _refused(
                    f"{kind} {tensor!r} is in shared memory region {name!r}, which is not registered"
                    + (f" (registered: {', '.join(sorted(self._regions)[:20])})" if self._regions else "")
                )
            region.users += 1
            return region

    def _release(self, region: _Region) -> None:
        with self._lock:
            region.users -= 1
            last = region.closing and region.users == 0
        if last:
            region.close()


class Lease:
    """The regions one request uses, held from decoding to its answer: :meth:`read_inputs`
    before the run, :meth:`write_outputs` after it, :meth:`release` at the end (always)."""

    def __init__(self, registry: SharedMemoryRegistry, request: SharedMemoryRequest) -> None:
        self._registry = registry
        self.request = request
        self._held: list[_Region] = []
        self._regions: dict[str, _Region] = {}
        try:
            for kind, tensors in (("input", request.inputs), ("output", request.outputs)):
                for t in tensors.values():
                    region = self._regions.get(t.region)
                    if region is None:
                        region = self._regions[t.region] = registry._acquire(t.region, t.name, kind)
                        self._held.append(region)
                    region.check(t, kind)
        except BaseException:
            self.release()
            raise

    @property
    def input_bytes(self) -> int:
        """The bytes of the request's inputs in shared memory."""
        return sum(t.byte_size for t in self.request.inputs.values())

    @property
    def output_bytes(self) -> int:
        """The bytes the request gave its outputs in shared memory (at most what is written)."""
        return sum(t.byte_size for t in self.request.outputs.values())

    def read_inputs(self, specs: Mapping[str, Any] | None = None) -> dict[str, np.ndarray[Any, Any]]:
        """The inputs in shared memory as arrays of their own (copies), by name.

        :raises ProtocolError: a BYTES input whose bytes are not length-prefixed UTF-8, a BOOL
            byte that is not 0 or 1, or a segment the client shrank.
        """
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for name, t in self.request.inputs.items():
            raw = self._regions[t.region].read(t.offset, t.byte_size)
            obj = {"name": name, "datatype": t.datatype, "shape": list(t.shape or ())}
            spec = specs.get(name) if specs is not None else None
            arrays[name] = decode_tensor(obj, binary=memoryview(raw.data), spec=spec, where=f"input {name!r}",
                                         size_name=BYTE_SIZE)  # fmt: skip
        return arrays

    def write_outputs(self, outputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, dict[str, Any]]:
        """Write each output the request placed in shared memory; the parameters its entry of the
        response carries, by name.

        :raises ProtocolError: an output larger than the bytes the request gave it, or a segment
            the client shrank. (The model ran: the request is at fault.)
        """
        written: dict[str, dict[str, Any]] = {}
        for name, t in self.request.outputs.items():
            array = outputs.get(name)
            if array is None:
                continue
            data = _wire_bytes(name, array)
            if data.nbytes > t.byte_size:
                raise _refused(
                    f"output {name!r} is {data.nbytes} bytes ({datatype_of(array, tensor=name)} of shape "
                    f"{list(array.shape)}), more than the {t.byte_size} bytes of {BYTE_SIZE} it was given in "
                    f"{self._regions[t.region].describe()}"
                )
            self._regions[t.region].write(t.offset, data)
            written[name] = response_parameters(t, data.nbytes)
        return written

    def release(self) -> None:
        held, self._held = self._held, []
        for region in held:
            self._registry._release(region)


def _wire_bytes(name: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An output's bytes as the protocol lays them out (little-endian, row-major; BYTES length-prefixed),
    as a flat uint8 array (a view of the output when it already is its own wire form)."""
    datatype = datatype_of(array, tensor=name)
    wire = WIRE_DTYPES.get(datatype)
    if wire is None:
        raw = encode_tensor(name, array, binary=True)[1]
        assert raw is not None
        return np.frombuffer(raw, np.uint8)
    return np.ascontiguousarray(array, dtype=wire).reshape(-1).view(np.uint8)


# -- system shared memory objects ----------------------------------------------------


#: Where a read's destination starts: the kernel's copy out of a shared memory object is slower
#: (5 to 30 % measured, by how far off) into memory that does not start on a cache line, as
#: numpy's large arrays often do not (malloc aligns to 16 bytes).
_ALIGN = 64


def _aligned_empty(size: int) -> np.ndarray[Any, Any]:
    """A fresh uint8 array of ``size`` bytes whose first byte starts a cache line."""
    raw = np.empty(size + _ALIGN - 1, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + size]


def _read_into(fd: int, out: np.ndarray[Any, Any], position: int) -> int:
    """Read ``out.nbytes`` bytes at ``position`` of ``fd`` into ``out`` (uint8, C-contiguous): the bytes
    read, fewer at the object's end. Straight into the array where ``preadv`` exists (one copy)."""
    view = out.data.cast("B")
    done = 0
    while done < len(view):
        if _PREADV is not None:
            n = _PREADV(fd, [view[done:]], position + done)
        else:
            chunk = os.pread(fd, len(view) - done, position + done)
            n = len(chunk)
            view[done : done + n] = chunk
        if n == 0:
            break
        done += n
    return done


def _write_from(fd: int, data: np.ndarray[Any, Any], position: int) -> None:
    """Write all of ``data`` (uint8, C-contiguous) at ``position`` of ``fd``."""
    view = data.data.cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], position + done)
        if n == 0:  # not for a regular file; never loop on it
            raise OSError(errno.EIO, "the write made no progress")
        done += n


_PREADV = getattr(os, "preadv", None)


def _open_segment(name: str, key: str) -> int:
    """A read/write descriptor of the POSIX shared memory object ``key`` (as shm_open names it)."""
    base = key.lstrip("/")  # as shm_open reads it
    if not base or "/" in base or base in (".", "..") or "\0" in base or len(base.encode("utf-8", "replace")) > 255:
        raise _refused(
            f"cannot register system shared memory region {name!r}: key {show(key)} is not the name of a POSIX "
            "shared memory object ('/name': no '/' but at the start; up to 255 bytes)"
        )
    where = f"the shared memory object {key!r}"
    try:
        if os.path.isdir(_SHM_DIR):
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(os.path.join(_SHM_DIR, base), flags)
        else:
            try:
                import _posixshmem  # type: ignore[import-not-found]  # multiprocessing.shared_memory's
            except ImportError:
                raise _refused(f"system shared memory is not supported on {sys.platform}") from None
            fd = _posixshmem.shm_open("/" + base, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise _refused(
            f"cannot register system shared memory region {name!r}: {where} does not exist on this machine "
            "(create it first, e.g. with tritonclient.utils.shared_memory.create_shared_memory_region, "
            "on the machine the server runs on)"
        ) from None
    except OSError as e:
        reason = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise _refused(
            f"cannot register system shared memory region {name!r}: cannot open {where} ({reason})"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise _refused(f"cannot register system shared memory region {name!r}: {where}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refused(f"cannot register system shared memory region {name!r}: {where} is not a shared memory object")
    return fd


def _region_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise _refused(f"a shared memory region's name is a non-empty string of at most {MAX_NAME_CHARS} "
                       f"characters, not {show(name)}")  # fmt: skip
    return name


def _count(value: object, what: str, name: str, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value >= 2**63:
        raise _refused(
            f"cannot register shared memory region {name!r}: {what!r} must be an integer of at least {minimum}, "
            f"not {show(value)}"
        )
    return value


def decode_raw_handle(value: object, name: str) -> bytes:
    """A REST register request's ``raw_handle`` (``{"b64": "..."}``) as bytes."""
    b64 = value.get("b64") if isinstance(value, dict) else None
    if not isinstance(b64, str):
        raise _refused(
            f'cannot register CUDA shared memory region {name!r}: raw_handle must be {{"b64": <the serialized '
            f"cudaIpcMemHandle_t, base64>}}, not {show(value)}"
        )
    try:
        return base64.b64decode(b64, validate=True)
    except ValueError:
        raise _refused(f"cannot register CUDA shared memory region {name!r}: raw_handle.b64 is not base64") from None


__all__ = ["CUDA", "ENABLE_HINT", "MAX_REGIONS", "SYSTEM", "Lease", "SharedMemoryRegistry"]
