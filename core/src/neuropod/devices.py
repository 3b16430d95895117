"""What this machine has: GPUs seen through NVML, or just a CPU.

:func:`local_host` asks NVML (again after :data:`HOST_MAX_AGE` seconds on a GPU host,
so free memory stays current in a long-lived process). A machine without the NVIDIA
driver is an ordinary CPU host, not an error: the returned :class:`Host` has
no GPUs and a ``note`` saying why none were seen.

:func:`load_host` reads a *host file*, a JSON description of another machine,
so deployments can be planned for it from a box without that hardware::

    {
      "name": "two A100s",
      "driver_version": "550.54.15",
      "cuda_driver_version": "12.4",
      "gpus": [
        {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0",
         "memory_total": "80GiB", "memory_free": "79GiB",
         "uuid": "GPU-5f3c9a7e-2b41-4c1e-9d0a-6b7e8f901234"},
        {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": [8, 0],
         "memory_total": 85899345920}
      ]
    }

Top level (every key optional):

- ``name``: absent or ``null`` means the file name without its extension.
- ``driver_version``: e.g. ``"550.54.15"``; ``cuda_driver_version``: e.g.
  ``"12.4"``, the newest CUDA the driver supports. Either may be ``null``.
- ``gpus``: a list of GPU objects; absent, ``null`` or ``[]`` is a CPU-only host.

Each GPU:

- ``name``, ``compute_capability`` and ``memory_total`` are required.
- ``compute_capability``: ``"8.6"``, ``8.6`` or ``[8, 6]``.
- ``memory_total`` / ``memory_free``: bytes as an integer, or a string with a
  unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of
  1024), e.g. ``"80GiB"``, ``"80 GB"``, ``"512MiB"``, ``"1.5TiB"``.
  ``memory_free`` defaults to ``memory_total`` and may not exceed it.
- ``index``: the CUDA index, defaults to the position in the list.
- ``uuid``: defaults to ``"GPU-described-<index>"``.

A host file may also list the backends installed on the machine it
describes, so a deployment can be planned from a machine without that
software; without ``backends``, planning uses this environment's backends::

    "backends": [
      {"platform": "tensorrt", "version": "10.3.0", "framework": "tensorrt-cu12-bindings",
       "cpu": false, "cuda": "12", "compute_capabilities": []}
    ]

(``platform`` and ``version`` are required; ``cpu`` defaults to true, ``cuda``
to null, meaning no GPU support.)

Unknown keys are rejected so a typo cannot silently drop a field. Every
problem raises :class:`~neuropod.errors.NeuropodError` naming the file and the
field.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuropod import _json
from neuropod.backend import Backend, DeviceCaps
from neuropod.errors import NeuropodError

_LOCAL_NAME = "this machine"
_GIB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Digit counts are bounded so a hostile file cannot hit int()'s digit limit.
_MEMORY_RE = re.compile(r"\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-z]{0,3})\s*", re.IGNORECASE | re.ASCII)
_CC_RE = re.compile(r"([0-9]{1,2})\.([0-9])", re.ASCII)
_CUDA_RE = re.compile(r"[0-9]{1,3}\.[0-9]{1,2}", re.ASCII)
_DEVICE_RE = re.compile(r"(cpu)|(?:cuda|gpu)(?::([0-9]{1,4}))?", re.IGNORECASE | re.ASCII)
_DEVICE_FORMS = '"cpu", "cuda", "cuda:N", "gpu", "gpu:N"'
_HOST_KEYS = ("name", "driver_version", "cuda_driver_version", "gpus", "backends")
_BACKEND_KEYS = ("platform", "version", "framework", "cpu", "cuda", "compute_capabilities")
_GPU_KEYS = ("index", "name", "uuid", "compute_capability", "memory_total", "memory_free")
_NOTE_LIMIT = 160
_MAX_MEMORY = 2**64


@dataclass(frozen=True, slots=True)
class GPU:
    """One CUDA device as NVML (or a host file) reports it."""

    index: int
    name: str
    uuid: str
    compute_capability: str
    memory_total: int
    memory_free: int

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"

    @property
    def cc_tuple(self) -> tuple[int, int]:
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)


@dataclass(frozen=True, slots=True)
class Host:
    """A machine: this one (from NVML) or one described in a host file."""

    name: str
    gpus: tuple[GPU, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    source: str = "nvml"
    note: str | None = None
    #: Backends installed on a described machine, as (Backend, DeviceCaps);
    #: empty means "plan with this environment's backends".
    backends: tuple[tuple[Backend, DeviceCaps], ...] = ()

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def devices(self) -> tuple[str, ...]:
        return ("cpu", *(gpu.device for gpu in self.gpus))

    def gpu(self, device: str) -> GPU:
        """The GPU a device name such as ``"cuda:1"`` or ``"gpu"`` refers to."""
        wanted = parse_device(device)
        for gpu in self.gpus:
            if gpu.device == wanted:
                return gpu
        asked = wanted if wanted == device else f"{wanted} (from {device!r})"
        kind = "is not a GPU" if wanted == "cpu" else "is not on this host"
        raise NeuropodError(
            f"Device {asked} {kind}; host {self.name!r} has: {', '.join(self.devices)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """This host in the host-file format; ``load_host`` reads it back."""
        # source and note say how this description was obtained, not what the
        # machine has, so they are not part of the file format.
        data: dict[str, Any] = {
            "name": self.name,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid,
                 "compute_capability": g.compute_capability,
                 "memory_total": g.memory_total, "memory_free": g.memory_free}
                for g in self.gpus
            ],
        }
        if self.backends:
            data["backends"] = [
                {"platform": b.platform, "version": b.version, "framework": b.framework, "cpu": c.cpu,
                 "cuda": c.cuda, "compute_capabilities": list(c.compute_capabilities)}
                for b, c in self.backends
            ]
        return data

    def describe(self) -> str:
        """One line per device, for CLI output."""
        width = max(len(device) for device in self.devices) + 2
        lines = [
            f"{g.device:<{width}}{g.name} (cc {g.compute_capability}, "
            f"{_gib(g.memory_free)} free of {_gib(g.memory_total)})"
            for g in self.gpus
        ]
        lines.append("cpu" if self.gpus else f"{'cpu':<{width}}{self.note or 'no GPU'}")
        return "\n".join(lines)


def parse_device(device: str) -> str:
    """Normalise a device name to ``"cpu"`` or ``"cuda:N"``."""
    match = _DEVICE_RE.fullmatch(device.strip()) if isinstance(device, str) else None
    if match is None:
        raise NeuropodError(f"Unknown device {device!r}; accepted forms are {_DEVICE_FORMS}")
    if match[1]:
        return "cpu"
    return f"cuda:{int(match[2] or 0)}"


def read_nvml() -> Host:
    """Ask NVML what GPUs this machine has. Never raises: no NVML is a CPU host."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001  # missing package, library, driver or device node alike
        return Host(_LOCAL_NAME, source="no-nvml", note=_note("NVML not available", exc))
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        gpus = tuple(_read_gpu(pynvml, index) for index in range(count))
        # Old drivers lack some system queries; the GPUs are still usable.
        driver = _optional(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))
        cuda = _optional(lambda: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion()))
    except Exception as exc:  # noqa: BLE001  # a half-working driver must not crash a CPU job
        return Host(_LOCAL_NAME, source="no-nvml", note=_note("NVML query failed", exc))
    finally:
        # Nothing we report depends on a clean shutdown.
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    note = None if gpus else "NVML found no GPUs"
    return Host(_LOCAL_NAME, gpus, driver, cuda, source="nvml", note=note)


#: Seconds :func:`local_host` keeps what NVML said about a machine with GPUs before asking again.
HOST_MAX_AGE = 1.0


class _LocalHost:
    """:func:`local_host`: NVML's answer, re-read when older than :data:`HOST_MAX_AGE` on a GPU host."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._host: Host | None = None
        self._read_at = 0.0

    def __call__(self) -> Host:
        with self._lock:
            host, now = self._host, time.monotonic()
            # Free memory changes as models load and unload (a server's lifetime is long), so a GPU host
            # is re-read; a host without NVML or GPUs will not grow any while this process runs.
            if host is None or (host.has_gpu and now - self._read_at > HOST_MAX_AGE):
                host = self._host = read_nvml()
                self._read_at = now
            return host

    def cache_clear(self) -> None:
        """Forget the last reading: the next call asks NVML."""
        with self._lock:
            self._host = None


local_host = _LocalHost()
local_host.__doc__ = """This machine: its GPUs as NVML reports them, or a CPU-only host.

Resolution calls it on every load, so a long-lived process (a server) sees
current free memory: a GPU host is re-read from NVML when the last reading is
more than :data:`HOST_MAX_AGE` seconds old (a read costs about a millisecond).
A host without NVML, or whose NVML sees no GPU, is read once per process.
``local_host.cache_clear()`` forces the next call to read NVML.
"""


def load_host(path: str | os.PathLike[str]) -> Host:
    """Read a host file (format in the module docstring)."""
    file = os.fspath(path)
    try:
        with open(file, encoding="utf-8") as f:
            # One character past the bound is enough for _json to refuse it (and /dev/zero ends).
            text = f.read(_json.MAX_BYTES + 1)
    except FileNotFoundError:
        raise NeuropodError(f"Host file {_show(file, 200)} does not exist") from None
    except OSError as exc:
        raise _bad(file, f"cannot be read: {exc.strerror or exc}") from exc
    except UnicodeError as exc:
        raise _bad(file, f"cannot be read: {exc}") from exc
    try:
        data = _json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(file, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # too deep, too large, or a number beyond int()'s digit limit
        raise _bad(file, f"not a host description: {exc}") from None
    if not isinstance(data, dict):
        raise _bad(file, f"the top level is {_show(data)} but must be an object")
    _check_keys(file, "the top level", data, _HOST_KEYS)
    name = _string(file, "name", Path(file).stem if data.get("name") is None else data["name"])
    driver = data.get("driver_version")
    if driver is not None:
        driver = _string(file, "driver_version", driver)
    cuda = data.get("cuda_driver_version")
    if cuda is not None and not (isinstance(cuda, str) and _CUDA_RE.fullmatch(cuda)):
        raise _field(file, "cuda_driver_version", cuda, 'a string like "12.4"')
    raw_gpus = data.get("gpus")
    if raw_gpus is None:
        raw_gpus = []
    if not isinstance(raw_gpus, list):
        raise _field(file, "gpus", raw_gpus, "a list of GPU objects")
    gpus = tuple(_load_gpu(file, position, raw) for position, raw in enumerate(raw_gpus))
    seen: set[int] = set()
    for position, gpu in enumerate(gpus):
        if gpu.index in seen:
            raise _bad(file, f"gpus[{position}].index is {gpu.index}, used by an earlier GPU")
        seen.add(gpu.index)
    raw_backends = data.get("backends")
    if raw_backends is None:
        raw_backends = []
    if not isinstance(raw_backends, list):
        raise _field(file, "backends", raw_backends, "a list of backend objects")
    backends = tuple(_load_backend(file, position, raw) for position, raw in enumerate(raw_backends))
    return Host(name, gpus, driver, cuda, source=file, backends=backends)


def _load_backend(file: str, position: int, raw: object) -> tuple[Backend, DeviceCaps]:
    """One entry of a host file's ``backends``: software installed on the described machine."""
    where = f"backends[{position}]"
    if not isinstance(raw, dict):
        raise _field(file, where, raw, "an object")
    _check_keys(file, where, raw, _BACKEND_KEYS)
    for key in ("platform", "version"):
        if key not in raw:
            raise _bad(file, f"{where}.{key} is missing")
    platform = _string(file, f"{where}.platform", raw["platform"])
    version = _string(file, f"{where}.version", raw["version"])
    framework = _string(file, f"{where}.framework", raw.get("framework", platform))
    cpu = raw.get("cpu", True)
    if not isinstance(cpu, bool):
        raise _field(file, f"{where}.cpu", cpu, "true or false")
    cuda_version = raw.get("cuda")
    if cuda_version is not None and not (isinstance(cuda_version, str) and re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,3}){0,2}", cuda_version)):
        raise _field(file, f"{where}.cuda", cuda_version, 'null or a string like "12.4"')
    ccs = raw.get("compute_capabilities") or []
    if not isinstance(ccs, list):
        raise _field(file, f"{where}.compute_capabilities", ccs, 'a list like ["8.0", "9.0"]')
    caps = tuple(_compute_capability(file, f"{where}.compute_capabilities[{i}]", cc) for i, cc in enumerate(ccs))
    backend = Backend(platform, version, framework, plugin=platform, plugin_distribution="(described)",
                      location=f"described in {Path(file).name}")  # fmt: skip
    return backend, DeviceCaps(cpu=cpu, cuda=cuda_version, compute_capabilities=caps)


def _read_gpu(nvml: Any, index: int) -> GPU:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return GPU(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        compute_capability=f"{int(major)}.{int(minor)}",
        memory_total=int(memory.total),
        memory_free=int(memory.free),
    )


def _optional(read: Callable[[], str]) -> str | None:
    try:
        return read()
    except Exception:  # noqa: BLE001  # any NVML failure here just means "unknown"
        return None


def _text(value: Any) -> str:
    # Older bindings return bytes, newer ones str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _cuda_version(value: Any) -> str:
    version = int(value)  # NVML encodes 12.4 as 12040
    return f"{version // 1000}.{version % 1000 // 10}"


def _note(prefix: str, exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    reason = lines[0] if lines else type(exc).__name__
    note = f"{prefix}: {reason}"
    return note if len(note) <= _NOTE_LIMIT else note[: _NOTE_LIMIT - 3] + "..."


def _gib(size: int) -> str:
    return f"{size / _GIB:.1f} GiB"


def _show(value: object, limit: int = 60) -> str:
    # Bounded so one huge value (or a 5000-character path) cannot swamp the error message.
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(file: str, message: str) -> NeuropodError:
    return NeuropodError(f"Host file {_show(file, 200)}: {message}")


def _field(file: str, field: str, value: object, expected: str) -> NeuropodError:
    return _bad(file, f"{field} is {_show(value)} but must be {expected}")


def _check_keys(file: str, where: str, data: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = [key for key in data if key not in allowed]
    if unknown:
        listed = ", ".join(repr(key) for key in unknown)
        raise _bad(file, f"{where} has unknown key(s) {listed}; allowed: {', '.join(allowed)}")


def _string(file: str, field: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _field(file, field, value, "a non-empty string")
    return value


def _load_gpu(file: str, position: int, raw: object) -> GPU:
    field = f"gpus[{position}]"
    if not isinstance(raw, dict):
        raise _field(file, field, raw, "an object")
    _check_keys(file, field, raw, _GPU_KEYS)
    for key in ("name", "compute_capability", "memory_total"):
        if key not in raw:
            raise _bad(file, f"{field}.{key} is missing")
    index = raw.get("index", position)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise _field(file, f"{field}.index", index, "a non-negative integer")
    total = _memory(file, f"{field}.memory_total", raw["memory_total"])
    free = _memory(file, f"{field}.memory_free", raw.get("memory_free", total))
    if free > total:
        raise _bad(file, f"{field}.memory_free ({free} bytes) is more than memory_total ({total} bytes)")
    return GPU(
        index=index,
        name=_string(file, f"{field}.name", raw["name"]),
        uuid=_string(file, f"{field}.uuid", raw.get("uuid", f"GPU-described-{index}")),
        compute_capability=_compute_capability(
            file, f"{field}.compute_capability", raw["compute_capability"]
        ),
        memory_total=total,
        memory_free=free,
    )


def _compute_capability(file: str, field: str, value: object) -> str:
    text: str | None = None
    if isinstance(value, str):
        text = value.strip()
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, list) and len(value) == 2 and all(
        isinstance(part, int) and not isinstance(part, bool) for part in value
    ):
        text = f"{value[0]}.{value[1]}"
    match = _CC_RE.fullmatch(text) if text is not None else None
    if match is None:
        raise _field(file, field, value, 'like "8.0" (or 8.0, or [8, 0])')
    return f"{int(match[1])}.{match[2]}"


def _memory(file: str, field: str, value: object) -> int:
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _field(file, field, value, "a non-negative number of bytes")
        size = value
    elif isinstance(value, str):
        match = _MEMORY_RE.fullmatch(value)
        unit = _UNITS.get(match[2].lower()) if match is not None else None
        if match is not None and unit is not None:
            number: str = match[1]
            whole, _, fraction = number.partition(".")
            # Integer arithmetic keeps "1.5TiB" exact; a fraction of a byte is dropped.
            scale: int = 10 ** len(fraction)
            size = int(whole + fraction) * unit // scale
    if size is None:
        raise _field(file, field, value, 'bytes or a size like "80GiB", "80 GB" or "512MiB"')
    # Sizes are shown as GiB floats; a 400-digit size would overflow them far from here.
    if size > _MAX_MEMORY:
        raise _field(file, field, value, f"at most {_MAX_MEMORY:,} bytes (16 EiB)")
    return size


__all__ = ["GPU", "HOST_MAX_AGE", "Host", "load_host", "local_host", "parse_device", "read_nvml"]
