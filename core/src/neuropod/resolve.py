"""Which backend runs a package on a host, and why the others don't.

Resolution keeps the candidates of the package's platform whose version is
in the package's range and that can run on a device the model may use. It
prefers a GPU when the model asks for one (``input_tensor_device`` says GPU,
or ``device_requirements`` asks for one) and one fits, then the newest
version. Among GPUs, the one that fits with the most free memory wins unless
the caller pins ``device="cuda:N"``. Every candidate keeps its reason, so a
failure can show the whole table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from neuropod.backend import Backend, DeviceCaps
from neuropod.devices import GPU, Host, parse_device
from neuropod.errors import NeuropodError, NoBackendError
from neuropod.package import ModelConfig
from neuropod.plugins import install_hint
from neuropod.versions import parse_range


@dataclass(frozen=True)
class Candidate:
    """One backend considered for a package, with the verdict."""

    backend: Backend
    caps: DeviceCaps
    device: str | None
    reason: str

    @property
    def accepted(self) -> bool:
        return self.device is not None


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolution: the choice and every candidate's verdict."""

    config: ModelConfig
    host: Host
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    requested_device: str | None = None
    requested_backend: str | None = None

    @property
    def device(self) -> str | None:
        return self.chosen.device if self.chosen else None

    def table(self) -> str:
        """The candidates as an aligned text table, the chosen one marked ``*``."""
        rows = [("", "backend", "framework", "plugin", "where", "verdict")]
        for c in self.candidates:
            mark = "*" if c is self.chosen else ("+" if c.accepted else "-")
            b = c.backend
            rows.append((mark, b.id, b.framework, b.plugin_distribution or b.plugin, b.location, c.reason))
        if len(rows) == 1:
            return "  (no backends are installed)"
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join(
            "  " + "  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows
        )

    def summary(self) -> str:
        """What was chosen, or why nothing was, and what to do about it."""
        cfg = self.config
        head = f"Model {cfg.name!r} needs platform {cfg.platform!r}, versions {describe_range(cfg.platform_version_semver)}"
        if self.chosen is not None:
            return f"{head}.\nChosen: {self.chosen.backend.id} on {self.chosen.device}."
        # "a backend satisfying these requirements was not found" is the original Neuropod's phrase.
        return (
            f"{head}.\nNo backend can run it on {self.host.name}: a backend satisfying these requirements "
            f"was not found. {self.advice()}"
        )

    def advice(self) -> str:
        cfg = self.config
        same = [c for c in self.candidates if c.backend.platform == cfg.platform]
        if not same:
            return f"No backend for platform {cfg.platform!r} is installed: {install_hint(cfg.platform)}."
        if self.requested_backend and all(c.reason.startswith(_NOT_PINNED) for c in same):
            return f"Nothing matches backend={self.requested_backend!r}; drop the pin or install that version."
        if not any(_in_range(c.backend, cfg.platform_version_semver) for c in same):
            # An exact pin (an AOTInductor package's "==2.13.0") names the one version that will do.
            pin = re.fullmatch(r"==(\d+(?:\.\d+)*)", parse_range(cfg.platform_version_semver).describe())
            version = pin.group(1) if pin else "VERSION"
            return (
                f"Install a {cfg.platform} version in {describe_range(cfg.platform_version_semver)}, "
                f"or create a backend environment with one: neuropod env create {cfg.platform}=={version}."
            )
        return "A backend of the right version exists but no device fits; see the table."

    def explain(self) -> str:
        """The full explanation printed by ``neuropod explain``."""
        return f"{self.summary()}\nHost: {self.host.name}\n{self.host.describe()}\nCandidates:\n{self.table()}"

    def raise_if_unresolved(self) -> Candidate:
        if self.chosen is None:
            raise NoBackendError(f"{self.summary()}\nCandidates:\n{self.table()}")
        return self.chosen


_NOT_PINNED = "not the requested backend"


def describe_range(text: str) -> str:
    described = parse_range(text).describe()
    return repr(text) if described == text else f"{text!r} ({described})"


def _in_range(backend: Backend, version_range: str) -> bool:
    rng = parse_range(version_range)
    try:
        return backend.version in rng
    except NeuropodError:
        return False


def gpu_preference(config: ModelConfig) -> tuple[bool, bool]:
    """(prefers a GPU, requires a GPU) for a package: it requires one when its
    ``device_requirements`` say so (a TensorRT engine), and prefers one when it
    requires one or an input's ``input_tensor_device`` is GPU (the original's default)."""
    kind = _required_kind(config)
    requires = kind in ("gpu", "cuda")
    if kind == "cpu":  # a program compiled or exported for the CPU alone
        return False, False
    prefers = requires or any(str(v).upper() == "GPU" for v in config.input_tensor_device.values())
    return prefers, requires


def _required_kind(config: ModelConfig) -> str:
    """``device_requirements["device"]``: "cuda"/"gpu" (needs a GPU), "cpu" (runs on the CPU only) or ""."""
    return str((config.device_requirements or {}).get("device", "")).lower()


def _cc_ok(gpu: GPU, caps: DeviceCaps, config: ModelConfig) -> str | None:
    """Why this GPU cannot run the model with this backend, or None."""
    req = config.device_requirements or {}
    need_cc = req.get("compute_capability")
    min_cc = req.get("min_compute_capability")
    if req.get("hardware_compatible"):
        # A hardware-compatible engine runs on any GPU from a generation on.
        if min_cc is not None and gpu.cc_tuple < _cc_tuple(str(min_cc)):
            return (
                f"{gpu.device} is compute capability {gpu.compute_capability}; the model was built hardware-compatible "
                f"for {min_cc} and newer"
            )
    elif need_cc is not None and str(need_cc) != gpu.compute_capability:
        return f"{gpu.device} is compute capability {gpu.compute_capability}, the model was built for {need_cc}"
    if caps.compute_capabilities and gpu.compute_capability not in caps.compute_capabilities:
        return (
            f"{gpu.device} is compute capability {gpu.compute_capability}; the backend has kernels for "
            f"{', '.join(caps.compute_capabilities)}"
        )
    need_mem = req.get("min_free_memory")
    if isinstance(need_mem, int) and gpu.memory_free < need_mem:
        return f"{gpu.device} has {_gib(gpu.memory_free)} free, the model needs {_gib(need_mem)}"
    return None


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, _, minor = cc.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return (0, 0)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _driver_ok(host: Host, caps: DeviceCaps) -> str | None:
    if caps.cuda is None or host.cuda_driver_version is None:
        return None
    try:
        if Version(host.cuda_driver_version).major < Version(caps.cuda).major:
            return f"the driver supports CUDA {host.cuda_driver_version}, the backend needs CUDA {caps.cuda}"
    except InvalidVersion:
        return None
    return None


def _pick_device(
    config: ModelConfig, caps: DeviceCaps, host: Host, device: str | None
) -> tuple[str | None, str]:
    prefers, requires = gpu_preference(config)
    if _required_kind(config) == "cpu":
        if device is not None and device != "cpu":
            return None, f"device={device!r} was requested, but the model was made for the CPU only"
        if not caps.cpu:
            return None, "the model was made for the CPU only, and this backend runs on GPUs only"
        return "cpu", "ok: cpu (the model was made for the CPU only)"
    if device == "cpu":
        if requires:
            return None, "device='cpu' was requested, but the model needs a GPU"
        if not caps.cpu:
            return None, "device='cpu' was requested, but this backend runs on GPUs only"
        return "cpu", "ok: cpu (requested)"
    gpu_reasons: list[str] = []
    fitting: list[GPU] = []
    if not caps.gpu:
        gpu_reasons.append("backend build has no GPU support")
    elif not host.has_gpu:
        gpu_reasons.append(f"host has no GPU ({host.note})" if host.note else "host has no GPU")
    else:
        driver = _driver_ok(host, caps)
        if driver:
            gpu_reasons.append(driver)
        else:
            for gpu in host.gpus:
                why = _cc_ok(gpu, caps, config)
                (gpu_reasons.append(why) if why else fitting.append(gpu))
    if device is not None:  # a pinned GPU
        pinned = [g for g in fitting if g.device == device]
        if pinned:
            return device, f"ok: {_describe_gpu(pinned[0])} (requested)"
        if not any(g.device == device for g in host.gpus):
            return None, f"device={device!r} was requested, but the host has no such GPU"
        return None, f"device={device!r} was requested, but " + "; ".join(gpu_reasons or ["it does not fit"])
    if fitting and (prefers or not caps.cpu):
        best = max(fitting, key=lambda g: (g.memory_free, -g.index))
        return best.device, f"ok: {_describe_gpu(best)}"
    if caps.cpu and not requires:
        why = "the model does not ask for a GPU" if fitting else "; ".join(gpu_reasons)
        return "cpu", f"ok: cpu ({why})" if why else "ok: cpu"
    if requires:
        return None, "needs a GPU: " + "; ".join(gpu_reasons or ["no GPU fits"])
    return None, "cannot run on the cpu, and " + "; ".join(gpu_reasons or ["no GPU fits"])


def _describe_gpu(gpu: GPU) -> str:
    return f"{gpu.device} {gpu.name}, cc {gpu.compute_capability}, {_gib(gpu.memory_free)} free"


def parse_backend_pin(pin: str) -> tuple[str, str | None]:
    """``"onnx==1.31.1"`` -> ("onnx", "==1.31.1"); ``"onnx"`` -> ("onnx", None); any range after the name."""
    if not isinstance(pin, str):
        raise TypeError(f"backend must be a str such as 'onnx' or 'onnx==1.31.1', not {type(pin).__name__} {pin!r:.60}")
    pin = pin.strip()
    for i, ch in enumerate(pin):
        if ch in "=<>!~^ ":
            name, rng = pin[:i].strip(), pin[i:].strip()
            if not name:
                break
            parse_range(rng)  # an invalid range raises a VersionRangeError quoting it
            return name, rng
    if not pin or not pin.replace("-", "").replace("_", "").isalnum():
        raise NeuropodError(f"backend={pin!r} is not like 'onnx' or 'onnx==1.31.1' or 'onnx>=1.20'")
    return pin, None


def resolve(
    config: ModelConfig,
    backends: Sequence[Backend],
    caps: Mapping[Backend, DeviceCaps],
    host: Host,
    *,
    device: str | None = None,
    backend: str | None = None,
) -> Resolution:
    """Choose a backend and device for a package.

    :param config: the package's config (platform, range, device wishes).
    :param backends: the candidates, e.g. :func:`neuropod.plugins.installed_backends`.
    :param caps: each candidate's :class:`DeviceCaps`.
    :param host: the machine to plan for.
    :param device: ``"cpu"`` or ``"cuda:N"`` to force a device.
    :param backend: a pin such as ``"onnx"`` or ``"onnx==1.31.1"``.
    :returns: the :class:`Resolution`; call ``raise_if_unresolved()`` to get
        the choice or a :class:`NoBackendError` with the table.
    """
    want_device = parse_device(device) if device is not None else None
    pin = parse_backend_pin(backend) if backend is not None else None
    rng = parse_range(config.platform_version_semver)
    candidates = []
    for b in backends:
        c = caps.get(b) or DeviceCaps()
        if b.platform != config.platform:
            candidates.append(Candidate(b, c, None, f"runs platform {b.platform!r}, not {config.platform!r}"))
            continue
        if pin is not None and (pin[0] != b.platform or (pin[1] and not _version_in(b.version, pin[1]))):
            candidates.append(Candidate(b, c, None, f"{_NOT_PINNED} {backend!r}"))
            continue
        if not _version_in(b.version, rng.text):
            candidates.append(
                Candidate(b, c, None, f"version {b.version} is not in {describe_range(rng.text)}")
            )
            continue
        chosen_device, reason = _pick_device(config, c, host, want_device)
        candidates.append(Candidate(b, c, chosen_device, reason))
    prefers, _ = gpu_preference(config)
    accepted = [c for c in candidates if c.accepted]

    def rank(c: Candidate) -> tuple[Any, ...]:
        on_gpu = c.device is not None and c.device.startswith("cuda")
        return (on_gpu == prefers, c.backend.location == "in-process", _sort_version(c.backend.version))

    chosen = max(accepted, key=rank) if accepted else None
    ordered = sorted(candidates, key=lambda c: (c is not chosen, not c.accepted, c.backend.platform != config.platform))
    return Resolution(config, host, tuple(ordered), chosen, want_device, backend)


def _version_in(version: str, range_text: str) -> bool:
    try:
        return version in parse_range(range_text)
    except NeuropodError:
        return False


def _sort_version(v: str) -> Version:
    try:
        return Version(v)
    except InvalidVersion:
        return Version("0")


__all__ = ["Candidate", "Resolution", "describe_range", "gpu_preference", "parse_backend_pin", "resolve"]
