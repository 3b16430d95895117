"""The on-disk package format: read and write, directory or zip.

A package is the original Neuropod 0.3 layout, which we read unchanged::

    config.json        name, platform, platform_version_semver, input_spec,
                       output_spec, custom_ops, input_tensor_device
    0/config.json      backend-specific settings
    0/data/            the model files
    0/ops/             custom-op libraries, loaded before the model

Packages we write add, without breaking that layout:

* ``manifest.json``: ``{"manifest_version": 1, "files": {relpath: sha256}}``
  for every other file. It is checked on load; a package that we wrote
  (its config has ``exported_with``) must have one. Original 0.3 packages
  have none and are read as they are.
* ``exported_with`` in ``config.json``: the exact framework version and the
  neuropod version that made the package, and ``device_requirements`` when
  the model needs a particular kind of device.
* ``test_data/inputs.npz`` and ``test_data/expected.npz``: test data stored
  without pickle. The original's ``test_data.pkl`` is read only when the
  caller says it trusts the package, because unpickling runs code.

Zip packages are written deterministically (sorted members, fixed times and
permissions), so the same model gives the same bytes. They are extracted
once into a cache keyed by the zip's content hash, refusing absolute paths,
``..``, links and more than a size bound of uncompressed data.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, PackageError
from neuropod.spec import TensorSpec, parse_spec, to_string_array
from neuropod.versions import parse_range

MANIFEST_VERSION = 1
CONFIG = "config.json"
MANIFEST = "manifest.json"
TEST_INPUTS = "test_data/inputs.npz"
TEST_EXPECTED = "test_data/expected.npz"
LEGACY_TEST_DATA = "test_data.pkl"

#: Default bound on a zip package's uncompressed size (override with
#: ``NEUROPOD_MAX_PACKAGE_BYTES``); a guard against zip bombs, not a quota.
DEFAULT_MAX_PACKAGE_BYTES = 32 * 2**30

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_KNOWN_KEYS = {
    "name",
    "platform",
    "platform_version_semver",
    "input_spec",
    "output_spec",
    "custom_ops",
    "input_tensor_device",
    "exported_with",
    "device_requirements",
}

FileSource = str | os.PathLike[str] | bytes


@dataclass(frozen=True)
class ModelConfig:
    """The parsed ``config.json`` of a package."""

    name: str
    platform: str
    platform_version_semver: str
    input_spec: tuple[TensorSpec, ...]
    output_spec: tuple[TensorSpec, ...]
    custom_ops: tuple[str, ...] = ()
    input_tensor_device: Mapping[str, str] = field(default_factory=dict)
    exported_with: Mapping[str, Any] | None = None
    device_requirements: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``config.json``."""
        out: dict[str, Any] = {
            "name": self.name,
            "platform": self.platform,
            "platform_version_semver": self.platform_version_semver,
            "input_spec": [s.to_dict() for s in self.input_spec],
            "output_spec": [s.to_dict() for s in self.output_spec],
            "custom_ops": list(self.custom_ops),
            "input_tensor_device": dict(self.input_tensor_device),
        }
        if self.exported_with is not None:
            out["exported_with"] = dict(self.exported_with)
        if self.device_requirements is not None:
            out["device_requirements"] = dict(self.device_requirements)
        out.update(self.extra)
        return out


def parse_config(data: Any, where: str) -> ModelConfig:
    """Check and read the JSON value of a ``config.json``.

    :param where: the file, for error messages.
    :raises PackageError: naming the file and the field that is wrong.
    """
    if not isinstance(data, dict):
        raise PackageError(f"{where}: the top level must be a JSON object, not {type(data).__name__}")
    for key in ("name", "platform", "input_spec", "output_spec"):
        if key not in data:
            raise PackageError(f"{where}: required field {key!r} is missing")
    name, platform = data["name"], data["platform"]
    if not isinstance(name, str) or not name:
        raise PackageError(f"{where}: 'name' must be a non-empty string, not {name!r}")
    if not isinstance(platform, str) or not platform:
        raise PackageError(f"{where}: 'platform' must be a non-empty string such as 'onnx', not {platform!r}")
    semver = data.get("platform_version_semver", "*")
    if semver is None:
        semver = "*"
    if not isinstance(semver, str):
        raise PackageError(f"{where}: 'platform_version_semver' must be a string such as '^1.20', not {semver!r}")
    try:
        parse_range(semver)
    except NeuropodError as e:
        raise PackageError(f"{where}: platform_version_semver: {e}") from None
    custom_ops = data.get("custom_ops") or []
    if not isinstance(custom_ops, list) or not all(isinstance(o, str) and _is_plain_name(o) for o in custom_ops):
        raise PackageError(f"{where}: 'custom_ops' must be a list of file names in 0/ops/, not {custom_ops!r}")
    devices = data.get("input_tensor_device") or {}
    if not isinstance(devices, dict) or not all(isinstance(v, str) for v in devices.values()):
        raise PackageError(f"{where}: 'input_tensor_device' must map input names to \"CPU\" or \"GPU\"")
    for key in ("exported_with", "device_requirements"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise PackageError(f"{where}: {key!r} must be an object, not {type(data[key]).__name__}")
    return ModelConfig(
        name=name,
        platform=platform,
        platform_version_semver=semver,
        input_spec=parse_spec(data["input_spec"], f"{where}: input_spec"),
        output_spec=parse_spec(data["output_spec"], f"{where}: output_spec"),
        custom_ops=tuple(custom_ops),
        input_tensor_device=dict(devices),
        exported_with=data.get("exported_with"),
        device_requirements=data.get("device_requirements"),
        extra={k: v for k, v in data.items() if k not in _KNOWN_KEYS},
    )


def _is_plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PackageError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PackageError(f"Cannot read {what} {path}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PackageError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an over-long integer, or nesting too deep to decode
        raise PackageError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Package:
    """A package on disk, read and checked; the input of resolution and loading."""

    root: Path
    config: ModelConfig
    source: Path
    manifest: Mapping[str, str] | None
    backend_config: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def platform(self) -> str:
        return self.config.platform

    @property
    def version_range(self) -> str:
        return self.config.platform_version_semver

    @property
    def data_dir(self) -> Path:
        """``0/data``: the model files."""
        return self.root / "0" / "data"

    @property
    def custom_op_paths(self) -> list[Path]:
        """The custom-op libraries to load before the model, in config order."""
        return [self.root / "0" / "ops" / op for op in self.config.custom_ops]

    def files(self) -> list[str]:
        """Every file of the package, as sorted POSIX relative paths."""
        return _list_files(self.root)

    @property
    def has_test_data(self) -> bool:
        return (self.root / TEST_INPUTS).is_file() or (self.root / LEGACY_TEST_DATA).is_file()

    def test_data(self, *, trust_pickle: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """The bundled test inputs and expected outputs (None when not bundled).

        :param trust_pickle: allow reading an original Neuropod ``test_data.pkl``.
            Unpickling runs code from the package: only for packages you trust.
        :raises PackageError: no test data, or only a pickle and no trust.
        """
        if (self.root / TEST_INPUTS).is_file():
            expected_path = self.root / TEST_EXPECTED
            return (
                _read_npz(self.root / TEST_INPUTS),
                _read_npz(expected_path) if expected_path.is_file() else None,
            )
        legacy = self.root / LEGACY_TEST_DATA
        if legacy.is_file():
            if not trust_pickle:
                raise PackageError(
                    f"Package {self.source} has test data only as {LEGACY_TEST_DATA}, a pickle, and unpickling "
                    "runs code from the package. Pass trust_pickle=True (CLI: --trust-pickle) only if you trust it."
                )
            return _read_legacy_pickle(legacy)
        raise PackageError(f"Package {self.source} has no bundled test data ({TEST_INPUTS})")


def read_package(path: str | os.PathLike[str], *, verify: bool = True, max_bytes: int | None = None) -> Package:
    """Open a package directory or zip and check it.

    :param path: a package directory, or a ``.zip`` of one.
    :param verify: check the files against ``manifest.json``.
    :param max_bytes: bound on a zip's uncompressed size (default
        ``NEUROPOD_MAX_PACKAGE_BYTES`` or 32 GiB).
    :raises PackageError: the package is missing, malformed, unsafe or changed.
    """
    source = Path(path)
    if source.is_dir():
        root = source
    elif source.is_file():
        root = extract_zip(source, max_bytes=max_bytes)
    else:
        raise PackageError(f"No Neuropod package at {source}: no such file or directory")
    config_path = root / CONFIG
    if not config_path.is_file():
        raise PackageError(f"{source} is not a Neuropod package: it has no {CONFIG}")
    config = parse_config(_read_json(config_path, "config"), str(config_path))
    manifest = _read_manifest(root)
    if manifest is None and config.exported_with is not None:
        raise PackageError(f"{source}: {MANIFEST} is missing, but the package was written with one")
    if manifest is not None and verify:
        _verify_manifest(root, manifest, source)
    backend_config: Any = {}
    backend_config_path = root / "0" / CONFIG
    if backend_config_path.is_file():
        backend_config = _read_json(backend_config_path, "backend config")
        if not isinstance(backend_config, dict):
            raise PackageError(f"{backend_config_path}: the top level must be a JSON object")
    return Package(root=root, config=config, source=source, manifest=manifest, backend_config=backend_config)


# --- manifest -------------------------------------------------------------


def _list_files(root: Path) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            files.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(files)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(root: Path) -> dict[str, str] | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    data = _read_json(path, "manifest")
    if (
        not isinstance(data, dict)
        or data.get("manifest_version") != MANIFEST_VERSION
        or not isinstance(data.get("files"), dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in data["files"].items())
    ):
        raise PackageError(
            f"{path}: expected {{\"manifest_version\": {MANIFEST_VERSION}, \"files\": {{path: sha256}}}}"
        )
    return dict(data["files"])


def _verify_manifest(root: Path, manifest: Mapping[str, str], source: Path) -> None:
    present = {f for f in _list_files(root) if f != MANIFEST}
    missing = sorted(set(manifest) - present)
    extra = sorted(present - set(manifest))
    changed = sorted(f for f in set(manifest) & present if _sha256(root / f) != manifest[f])
    problems = []
    if changed:
        problems.append("changed: " + ", ".join(changed))
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if extra:
        problems.append("not in the manifest: " + ", ".join(extra))
    if problems:
        raise PackageError(
            f"Package {source} does not match its {MANIFEST} ({'; '.join(problems)}). "
            "It was modified after it was written; rebuild it or restore the original files."
        )


def make_manifest(root: Path) -> dict[str, Any]:
    """The manifest of every file under ``root`` except the manifest itself."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "files": {f: _sha256(root / f) for f in _list_files(root) if f != MANIFEST},
    }


# --- test data ------------------------------------------------------------


def _write_npz(path: Path, tensors: Mapping[str, Any]) -> None:
    # np.savez stamps the current time into the zip; write members ourselves
    # so that the same data always gives the same bytes.
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(tensors):
            arr = np.asarray(tensors[name])
            if arr.dtype.kind in "OS":
                arr = to_string_array(arr)
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(_zip_info(f"{name}.npy"), buf.getvalue())


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise PackageError(f"Cannot read test data {path}: {e}") from None


def _read_legacy_pickle(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    try:
        with open(path, "rb") as f:
            # Neuropod 0.3 wrote these from Python 2: latin1 restores numpy's buffers.
            data = pickle.load(f, encoding="latin1")  # noqa: S301 - the caller said it trusts the package
    except Exception as e:  # anything can fail inside an unpickler
        raise PackageError(f"Cannot read legacy test data {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("test_input"), dict):
        raise PackageError(f"{path}: expected a dict with 'test_input' (and optionally 'test_output')")
    expected = data.get("test_output")
    return dict(data["test_input"]), (dict(expected) if isinstance(expected, dict) else None)


# --- writing --------------------------------------------------------------


def packager_config(
    model_name: str,
    platform: str,
    input_spec: Any,
    output_spec: Any,
    *,
    platform_version_semver: str = "*",
    framework_distributions: Iterable[str] = (),
    input_tensor_device: Mapping[str, str] | None = None,
    default_input_tensor_device: str = "GPU",
    device_requirements: Mapping[str, Any] | None = None,
    exported_with: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """The ``config.json`` every ``create_*_neuropod`` writes, from its usual arguments.

    Records the neuropod version and the first of ``framework_distributions``
    that is installed (its name and exact version) as ``exported_with``;
    inputs not in ``input_tensor_device`` get ``default_input_tensor_device``,
    as in the original Neuropod's packagers.
    """
    from neuropod import __version__
    from neuropod.backend import installed_distribution

    inputs = parse_spec(input_spec, "input_spec")
    devices = {s.name: default_input_tensor_device for s in inputs}
    devices.update(input_tensor_device or {})
    made: dict[str, Any] = {"neuropod": __version__}
    found = installed_distribution(*framework_distributions) if framework_distributions else None
    if found:
        made.update(framework=found[0], platform_version=found[1])
    made.update(exported_with or {})
    return ModelConfig(
        name=model_name,
        platform=platform,
        platform_version_semver=platform_version_semver,
        input_spec=inputs,
        output_spec=parse_spec(output_spec, "output_spec"),
        input_tensor_device=devices,
        exported_with=made,
        device_requirements=device_requirements,
    )


def write_package(
    neuropod_path: str | os.PathLike[str],
    config: ModelConfig,
    files: Mapping[str, FileSource],
    *,
    backend_config: Mapping[str, Any] | None = None,
    custom_ops: Iterable[str | os.PathLike[str]] = (),
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    package_as_zip: bool = False,
) -> Path:
    """Write a package; the building block of every ``create_*_neuropod``.

    :param neuropod_path: where to write: a directory, or a zip file when
        ``package_as_zip``. It must not exist yet.
    :param config: what goes into ``config.json``; ``custom_ops`` is filled
        in from the libraries given here.
    :param files: package-relative path (e.g. ``"0/data/model.onnx"``) to a
        file or directory to copy, or the bytes to write.
    :param backend_config: written to ``0/config.json`` when given.
    :param custom_ops: custom-op libraries to copy into ``0/ops/``.
    :returns: the path written.
    """
    dest = Path(neuropod_path)
    # Check the config as a reader will see it before writing anything.
    config = parse_config(json.loads(json.dumps(config.to_dict())), f"config of {dest}")
    if dest.exists():
        raise PackageError(f"{dest} already exists; choose a new path or remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".neuropod-", dir=dest.parent))
    try:
        op_names = []
        for op in custom_ops:
            op_path = Path(op)
            if not op_path.is_file():
                raise PackageError(f"Custom op library {op_path} does not exist")
            if op_path.name in op_names:
                raise PackageError(f"Two custom op libraries are named {op_path.name!r}; rename one")
            _copy_into(staging, f"0/ops/{op_path.name}", op_path)
            op_names.append(op_path.name)
        for rel, src in files.items():
            _copy_into(staging, rel, src)
        if backend_config is not None:
            _write_text(staging / "0" / CONFIG, json.dumps(dict(backend_config), indent=2, sort_keys=True) + "\n")
        config = replace(config, custom_ops=tuple(op_names))
        _write_text(staging / CONFIG, json.dumps(config.to_dict(), indent=2) + "\n")
        if test_input_data is not None:
            _write_npz(staging / TEST_INPUTS, test_input_data)
            if test_expected_out is not None:
                _write_npz(staging / TEST_EXPECTED, test_expected_out)
        _write_text(staging / MANIFEST, json.dumps(make_manifest(staging), indent=2, sort_keys=True) + "\n")
        if package_as_zip:
            write_zip(staging, dest)
        else:
            staging.chmod(0o755)  # mkdtemp made it private; a package is meant to be shared
            staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _copy_into(root: Path, rel: str, src: FileSource) -> None:
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise PackageError(f"Package file path {rel!r} must be relative and stay inside the package")
    target = root.joinpath(*parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(src, bytes):
        target.write_bytes(src)
        return
    src_path = Path(src)
    if src_path.is_dir():
        shutil.copytree(src_path, target, symlinks=False)
    elif src_path.is_file():
        shutil.copyfile(src_path, target)
    else:
        raise PackageError(f"Cannot package {src_path}: no such file or directory")


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # unix, so the permission bits below mean the same everywhere
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


def write_zip(root: Path, dest: Path) -> None:
    """Zip a package directory deterministically: same files, same bytes."""
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(tmp, "w") as zf:
            for rel in _list_files(root):
                with open(root / rel, "rb") as f:
                    zf.writestr(_zip_info(rel), f.read())
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


# --- safe extraction ------------------------------------------------------


def cache_dir() -> Path:
    """Where extracted zip packages live: ``NEUROPOD_CACHE_DIR``, else ``$XDG_CACHE_HOME/neuropod``."""
    env = os.environ.get("NEUROPOD_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "neuropod"


def _max_bytes() -> int:
    env = os.environ.get("NEUROPOD_MAX_PACKAGE_BYTES")
    if not env:
        return DEFAULT_MAX_PACKAGE_BYTES
    try:
        return int(env)
    except ValueError:
        raise PackageError(f"NEUROPOD_MAX_PACKAGE_BYTES must be a number of bytes, not {env!r}") from None


def _safe_members(zf: zipfile.ZipFile, source: Path, max_bytes: int) -> list[tuple[zipfile.ZipInfo, str]]:
    members = []
    total = 0
    for info in zf.infolist():
        name = info.filename
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise PackageError(f"Zip package {source} holds a link {name!r}; links are not allowed in packages")
        if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
            raise PackageError(f"Zip package {source} holds an absolute or non-POSIX path {name!r}")
        parts = PurePosixPath(name).parts
        if ".." in parts:
            raise PackageError(f"Zip package {source} holds a path that leaves the package: {name!r}")
        if info.is_dir():
            continue
        total += info.file_size
        if total > max_bytes:
            raise PackageError(
                f"Zip package {source} unpacks to more than {max_bytes} bytes "
                "(raise NEUROPOD_MAX_PACKAGE_BYTES if the package is really that large)"
            )
        members.append((info, "/".join(p for p in parts if p != ".")))
    return members


def extract_zip(source: Path, *, max_bytes: int | None = None) -> Path:
    """Extract a zip package into the cache, once per content hash.

    :returns: the package root inside the cache.
    """
    bound = _max_bytes() if max_bytes is None else max_bytes
    digest = _sha256(source)
    packages = cache_dir() / "packages"
    final = packages / digest[:32]
    if final.is_dir():
        return _package_root(final, source)
    try:
        packages.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=packages))
    except OSError as e:
        raise PackageError(f"Cannot create the package cache at {packages}: {e}") from None
    try:
        try:
            with zipfile.ZipFile(source) as zf:
                written = 0
                for info, rel in _safe_members(zf, source, bound):
                    target = tmp.joinpath(*rel.split("/"))
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(info) as src, open(target, "wb") as dst:
                        # Headers can lie about sizes: count what really comes out.
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            written += len(chunk)
                            if written > bound:
                                raise PackageError(f"Zip package {source} unpacks to more than {bound} bytes")
                            dst.write(chunk)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, RuntimeError) as e:
            raise PackageError(f"{source} is not a readable zip package: {e}") from None
        except OSError as e:  # e.g. members "a" and "a/b", or a member named "."
            raise PackageError(f"Cannot extract zip package {source}: {e}") from None
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # another process extracted it first otherwise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _package_root(final, source)


def _package_root(extracted: Path, source: Path) -> Path:
    if (extracted / CONFIG).is_file():
        return extracted
    # Some tools zip the folder itself: accept exactly one top-level folder.
    children = [p for p in extracted.iterdir()]
    if len(children) == 1 and (children[0] / CONFIG).is_file():
        return children[0]
    raise PackageError(f"{source} is not a Neuropod package: the zip has no {CONFIG} at its top level")


__all__ = [
    "ModelConfig",
    "packager_config",
    "Package",
    "cache_dir",
    "extract_zip",
    "make_manifest",
    "parse_config",
    "read_package",
    "write_package",
    "write_zip",
]
