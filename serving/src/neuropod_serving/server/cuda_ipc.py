"""The CUDA runtime calls CUDA shared memory needs (opening a client's CUDA IPC handle, copies to and
from it), through ctypes on ``libcudart``, found when the first CUDA region is registered (never at
import): only where NVML sees a GPU and the library loads. The regions themselves are
:mod:`~neuropod_serving.server.shm_regions`'.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import sys
import threading

from neuropod.devices import local_host
from neuropod_serving.errors import ProtocolError

log = logging.getLogger("neuropod_serving.server")

#: Bytes of a cudaIpcMemHandle_t.
IPC_HANDLE_BYTES = 64
_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_CUDA_MEMCPY_DEVICE_TO_HOST = 2
_CUDA_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def ipc_handle(raw_handle: bytes) -> IpcHandle:
    """A cudaIpcMemHandle_t holding ``raw_handle``'s bytes, all of them (assigning bytes to a ctypes
    char array would stop at the first NUL, and handles hold many)."""
    return IpcHandle.from_buffer_copy(raw_handle)


class CudaRuntime:
    """The few CUDA runtime calls CUDA shared memory needs, through ctypes on ``libcudart``."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = library
        self._lock = threading.Lock()
        library.cudaSetDevice.argtypes = [ctypes.c_int]
        library.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
        library.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        library.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        library.cudaGetErrorString.argtypes = [ctypes.c_int]
        library.cudaGetErrorString.restype = ctypes.c_char_p
        library.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            reason = self._lib.cudaGetErrorString(code).decode("utf-8", "replace")
            raise ProtocolError(f"{what}: CUDA error {code} ({reason})")

    def open(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> int:
        what = f"cannot register CUDA shared memory region {name!r}"
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise ProtocolError(f"{what}: raw_handle is {len(raw_handle)} bytes; a CUDA IPC handle is {IPC_HANDLE_BYTES}")
        count = ctypes.c_int(0)
        self._check(self._lib.cudaGetDeviceCount(ctypes.byref(count)), what)
        if device_id >= count.value:
            raise ProtocolError(f"{what}: device_id {device_id} is not a GPU of this machine (it has {count.value})")
        handle = ipc_handle(raw_handle)
        pointer = ctypes.c_void_p()
        with self._lock:
            self._check(self._lib.cudaSetDevice(device_id), what)
            self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), handle,
                                                      _CUDA_IPC_LAZY_ENABLE_PEER_ACCESS), what)  # fmt: skip
        address = int(pointer.value or 0)
        size = _allocation_size(address)
        if size is not None and byte_size > size:
            self.close(device_id, address)
            raise ProtocolError(f"{what}: byte_size {byte_size} is more than the {size} bytes the handle's memory holds")
        return address

    def copy(self, device_id: int, dst: int, src: int, size: int, *, to_device: bool) -> None:
        kind = _CUDA_MEMCPY_HOST_TO_DEVICE if to_device else _CUDA_MEMCPY_DEVICE_TO_HOST
        # The current device is per thread: set it on the thread that copies.
        self._check(self._lib.cudaSetDevice(device_id), "CUDA shared memory")
        self._check(self._lib.cudaMemcpy(dst, src, size, kind), "copying to or from CUDA shared memory")

    def close(self, device_id: int, address: int) -> None:
        code = self._lib.cudaSetDevice(device_id) or self._lib.cudaIpcCloseMemHandle(address)
        if code:
            log.warning("closing a CUDA IPC handle failed: CUDA error %d", code)


def _allocation_size(address: int) -> int | None:
    """The size of the device allocation ``address`` is in (the driver's cuMemGetAddressRange), or None
    when the driver library cannot say."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        query = driver.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    query.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if query(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)) != 0:
        return None
    return int(size.value) - (address - int(base.value))


def _cudart_candidates() -> list[str]:
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    # The runtime NVIDIA's wheels install (with torch, cupy or cuda-python), found without importing them.
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*")), reverse=True)
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cu1*", "lib", "libcudart.so*")), reverse=True)
        names += sorted(glob.glob(os.path.join(root, "torch", "lib", "libcudart*.so*")), reverse=True)
    return names


@functools.cache
def _cuda_runtime_or_reason() -> tuple[CudaRuntime | None, str]:
    host = local_host()
    if not host.has_gpu:
        return None, f"no GPU found ({host.note or 'NVML sees none'})"
    tried = []
    for candidate in _cudart_candidates():
        try:
            library = ctypes.CDLL(candidate)
        except OSError:
            tried.append(candidate)
            continue
        return CudaRuntime(library, candidate), ""
    return None, (
        "no CUDA runtime library found (libcudart: install one, e.g. pip install nvidia-cuda-runtime-cu12, "
        "or a CUDA build of torch)"
    )


def cuda_runtime() -> CudaRuntime:
    runtime, reason = _cuda_runtime_or_reason()
    if runtime is None:
        raise ProtocolError(f"CUDA shared memory needs a GPU and the CUDA runtime (libcudart): {reason}")
    return runtime


__all__ = ["IPC_HANDLE_BYTES", "CudaRuntime", "IpcHandle", "cuda_runtime", "ipc_handle"]
