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

What a package may contain: regular files and directories only. A symbolic
link, FIFO, device or socket anywhere in a directory package is refused with
a ``PackageError`` naming it, before any file is opened (a FIFO would block
the hash forever, a link to ``/dev/zero`` never end it); links are refused
even when they point inside the package, as they are in zips, so that what is
hashed, zipped and loaded is one set of bytes. Files are opened with
``O_NOFOLLOW | O_NONBLOCK`` and checked again after opening, so a file
swapped for a FIFO after the check is refused too.

Zip packages are written deterministically (sorted members, fixed times and
permissions), so the same model gives the same bytes, under a temporary name
unique to the writer and moved into place only when complete. They are
extracted once into a cache keyed by the zip's content hash
(:mod:`neuropod.cache` says what the cache trusts and how an entry is
checked), refusing absolute paths, ``..``, links, duplicate names, encrypted
members, more than ``NEUROPOD_MAX_PACKAGE_BYTES`` (default 32 GiB) of
uncompressed data and more than ``NEUROPOD_MAX_PACKAGE_FILES`` (default
100000) members. A damaged member is a ``PackageError`` naming the zip and
the member. Loading a zip that is in the cache reads the zip once to hash it
and stats the extracted files: they are not read again, and the manifest is
checked against the hashes taken when they were extracted.

The JSON files of a package are read with bounded depth and size
(:mod:`neuropod._json`): a config nested 100000 deep is a ``PackageError``,
never a ``RecursionError`` that breaks the next load. ``manifest_version`` 1
is the only version this neuropod reads.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import secrets
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from neuropod import _json, cache
from neuropod._args import check_flag
from neuropod._version import __version__
from neuropod.cache import DEFAULT_MAX_PACKAGE_BYTES, DEFAULT_MAX_PACKAGE_FILES, cache_dir, verify_cache
from neuropod.errors import NeuropodError, PackageError, VersionRangeError
from neuropod.spec import TensorSpec, parse_spec, to_string_array
from neuropod.versions import parse_range

MANIFEST_VERSION = 1
CONFIG = "config.json"
MANIFEST = "manifest.json"
REQUIREMENTS_LOCK = "requirements.lock"
TEST_INPUTS = "test_data/inputs.npz"
TEST_EXPECTED = "test_data/expected.npz"
LEGACY_TEST_DATA = "test_data.pkl"

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
    "output_labels",
}

FileSource = str | os.PathLike[str] | bytes

#: The compressions a package zip may use (what ``zip_compression=`` accepts).
_ZIP_COMPRESSIONS = (zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED)
_ZIP_CHUNK = 1 << 20


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
    #: Class labels of outputs, by output name: label ``i`` names index ``i`` of a row of the
    #: output (what a server's classification answers, ``score:index:label``).
    output_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
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
        if self.output_labels:
            out["output_labels"] = {k: list(v) for k, v in self.output_labels.items()}
        out.update(self.extra)
        return out


class _RangeError(PackageError, VersionRangeError):
    """A package's (or packager call's) ``platform_version_semver`` does not parse: a
    :class:`PackageError` and a :class:`VersionRangeError`, so also the ``RuntimeError``
    the original Neuropod raised for it."""


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
        raise _RangeError(f"{where}: platform_version_semver: {e}") from None
    # Only a missing or null field means "none": `or []` would let "", 0 or {} through.
    custom_ops = data.get("custom_ops")
    if custom_ops is None:
        custom_ops = []
    if not isinstance(custom_ops, list) or not all(isinstance(o, str) and _is_plain_name(o) for o in custom_ops):
        raise PackageError(f"{where}: 'custom_ops' must be a list of file names in 0/ops/, not {custom_ops!r}")
    devices = data.get("input_tensor_device")
    if devices is None:
        devices = {}
    if not isinstance(devices, dict) or not all(isinstance(v, str) for v in devices.values()):
        raise PackageError(f"{where}: 'input_tensor_device' must map input names to \"CPU\" or \"GPU\"")
    for key in ("exported_with", "device_requirements"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise PackageError(f"{where}: {key!r} must be an object, not {type(data[key]).__name__}")
    output_spec = parse_spec(data["output_spec"], f"{where}: output_spec")
    return ModelConfig(
        name=name,
        platform=platform,
        platform_version_semver=semver,
        input_spec=parse_spec(data["input_spec"], f"{where}: input_spec"),
        output_spec=output_spec,
        custom_ops=tuple(custom_ops),
        input_tensor_device=dict(devices),
        exported_with=data.get("exported_with"),
        device_requirements=data.get("device_requirements"),
        output_labels=parse_output_labels(data.get("output_labels"), output_spec, f"{where}: output_labels"),
        extra={k: v for k, v in data.items() if k not in _KNOWN_KEYS},
    )


def parse_output_labels(value: Any, output_spec: Iterable[TensorSpec], where: str) -> dict[str, tuple[str, ...]]:
    """Check ``output_labels`` (``config.json``, or the packager option of that name): an object of
    output name to a list of label strings, one per class index. Absent or null: no labels.

    :raises PackageError: not such an object, an unknown output, a label that is not a string
        (or holds a line break), or a string output (classification needs numbers).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PackageError(f"{where} must map output names to lists of class labels, not {type(value).__name__}")
    outputs = {s.name: s for s in output_spec}
    labels: dict[str, tuple[str, ...]] = {}
    for name, entries in value.items():
        spec = outputs.get(name)
        if spec is None:
            raise PackageError(
                f"{where}: {name!r} is not an output of the model; its outputs are: {', '.join(outputs) or '(none)'}"
            )
        if spec.dtype == "string":
            raise PackageError(f"{where}: output {name!r} is a string tensor; class labels name the indices of numbers")
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise PackageError(f"{where}: the labels of output {name!r} must be a non-empty list of strings")
        for i, label in enumerate(entries):
            if not isinstance(label, str) or "\n" in label or "\r" in label:
                raise PackageError(
                    f"{where}: label {i} of output {name!r} must be a string without line breaks, not {label!r:.80}"
                )
        labels[name] = tuple(entries)
    return labels


def _is_plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _read_json(path: Path, what: str, shown: Path | None = None) -> Any:
    """Read a package's JSON file, bounded; ``shown`` is how messages name it (a path in a zip)."""
    if shown is not None:
        try:
            return _read_json(path, what)
        except PackageError as e:
            raise PackageError(str(e).replace(str(path), str(shown))) from None
    try:
        with cache.open_regular(path) as f:
            raw = f.read(_json.MAX_BYTES + 1)
    except PackageError as e:
        raise PackageError(f"Cannot read {what} {path}: {e}") from None
    except OSError as e:
        raise PackageError(f"Cannot read {what} {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PackageError(f"Cannot read {what} {path}: it is not UTF-8 ({e})") from None
    try:
        return _json.loads(text)
    except json.JSONDecodeError as e:
        raise PackageError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except ValueError as e:  # too deep, too large, or an integer too long to convert
        raise PackageError(f"{path} is not valid JSON: {e}") from None


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
    def original_format(self) -> bool:
        """Written by the original Neuropod (its config has no ``exported_with``).

        Such packages keep the original's spec rule that a symbol is checked
        within the inputs and within the outputs separately, not across both.
        """
        return self.config.exported_with is None

    @property
    def data_dir(self) -> Path:
        """``0/data``: the model files."""
        return self.root / "0" / "data"

    @property
    def requirements_lock(self) -> str | None:
        """The text of ``0/requirements.lock``, or None when the package has none.

        A package with a lock runs in a worker whose Python environment is
        built from it (see :func:`neuropod.envs.lock_environment`).

        :raises PackageError: the file is not UTF-8 text of at most 1 MiB.
        """
        path = self.root / "0" / REQUIREMENTS_LOCK
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                data = f.read((1 << 20) + 1)
        except OSError as e:
            raise PackageError(f"Package {self.source}: cannot read 0/{REQUIREMENTS_LOCK}: {e.strerror}") from None
        if len(data) > 1 << 20:
            raise PackageError(f"Package {self.source}: 0/{REQUIREMENTS_LOCK} is larger than 1 MiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PackageError(f"Package {self.source}: 0/{REQUIREMENTS_LOCK} is not UTF-8 text ({e})") from None

    @property
    def custom_op_paths(self) -> list[Path]:
        """The custom-op libraries to load before the model, in config order."""
        return [self.root / "0" / "ops" / op for op in self.config.custom_ops]

    def files(self) -> list[str]:
        """Every file of the package, as sorted POSIX relative paths.

        :raises PackageError: the package now holds a link, FIFO or device.
        """
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


def read_package(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    max_bytes: int | None = None,
    max_files: int | None = None,
) -> Package:
    """Open a package directory or zip and check it.

    :param path: a package directory, or a ``.zip`` of one.
    :param verify: check the files against ``manifest.json``.
    :param max_bytes: bound on a zip's uncompressed size (default
        ``NEUROPOD_MAX_PACKAGE_BYTES`` or 32 GiB).
    :param max_files: bound on a zip's member count (default
        ``NEUROPOD_MAX_PACKAGE_FILES`` or 100000).
    :raises PackageError: the package is missing, malformed, unsafe or changed.
    :raises TypeError, ValueError: ``max_bytes`` or ``max_files`` is not a positive int.
    """
    cache.check_limit_argument("max_bytes", max_bytes)
    cache.check_limit_argument("max_files", max_files)
    source = Path(path)
    try:
        mode = os.stat(source).st_mode  # the package path itself may be a link (e.g. "current" -> "v3")
    except (FileNotFoundError, NotADirectoryError):
        raise PackageError(f"No Neuropod package at {source}: no such file or directory") from None
    except OSError as e:
        raise PackageError(f"Cannot read the package at {source}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        return _read_tree(source, source, None, verify, source)
    if not stat.S_ISREG(mode):
        raise PackageError(f"{source} is {cache.file_kind(mode)}, not a package directory or zip file")

    def check(extracted: Path, records: Mapping[str, cache.FileRecord]) -> None:
        # A zip that is not a sound package never enters the cache.
        root, hashes = _zip_root(extracted, records, source)
        _read_tree(root, source, hashes, verify, source / root.relative_to(extracted))

    entry = cache.extract(
        source,
        max_bytes=cache.max_package_bytes() if max_bytes is None else max_bytes,
        max_files=cache.max_package_files() if max_files is None else max_files,
        check=check,
    )
    root, hashes = _zip_root(entry.path, entry.files, source)
    return _read_tree(root, source, hashes, verify, source / root.relative_to(entry.path))


def _read_tree(root: Path, source: Path, hashes: Mapping[str, str] | None, verify: bool, shown: Path) -> Package:
    """Read and check the package whose files are under ``root``.

    :param hashes: the sha256 of every file, known from extraction (a zip);
        None for a directory, which is scanned and hashed here.
    :param shown: how messages name ``root``: itself, or the zip (and folder in it).
    """
    files: Collection[str] = cache.scan_tree(root) if hashes is None else hashes
    if CONFIG not in files:
        raise PackageError(f"{source} is not a Neuropod package: it has no {CONFIG}")
    config = parse_config(_read_json(root / CONFIG, "config", shown / CONFIG), str(shown / CONFIG))
    manifest = _read_manifest(root, shown) if MANIFEST in files else None
    if manifest is None and config.exported_with is not None:
        raise PackageError(f"{source}: {MANIFEST} is missing, but the package was written with one")
    if manifest is not None and verify:
        _verify_manifest(root, manifest, source, files, hashes)
    backend_config: Any = {}
    if f"0/{CONFIG}" in files:
        backend_config = _read_json(root / "0" / CONFIG, "backend config", shown / "0" / CONFIG)
        if not isinstance(backend_config, dict):
            raise PackageError(f"{shown / '0' / CONFIG}: the top level must be a JSON object")
    return Package(root=root, config=config, source=source, manifest=manifest, backend_config=backend_config)


def _zip_root(extracted: Path, records: Mapping[str, cache.FileRecord], source: Path) -> tuple[Path, dict[str, str]]:
    """The package root inside an extracted zip, and the sha256 of each file by root-relative path."""
    if CONFIG in records:
        return extracted, {rel: r.sha256 for rel, r in records.items()}
    # Some tools zip the folder itself: accept exactly one top-level folder.
    tops = {rel.split("/", 1)[0] for rel in records}
    if len(tops) == 1:
        top = tops.pop()
        if f"{top}/{CONFIG}" in records:
            cut = len(top) + 1
            return extracted / top, {rel[cut:]: r.sha256 for rel, r in records.items()}
    raise PackageError(f"{source} is not a Neuropod package: the zip has no {CONFIG} at its top level")


# --- manifest -------------------------------------------------------------


def _list_files(root: Path) -> list[str]:
    return sorted(cache.scan_tree(root))


def _read_manifest(root: Path, shown: Path) -> dict[str, str]:
    path = shown / MANIFEST
    data = _read_json(root / MANIFEST, "manifest", path)
    expected = f'{{"manifest_version": {MANIFEST_VERSION}, "files": {{path: sha256}}}}'
    if not isinstance(data, dict):
        raise PackageError(f"{path}: expected {expected}, not a JSON {type(data).__name__}")
    if "manifest_version" not in data:
        raise PackageError(f"{path}: 'manifest_version' is missing; expected {expected}")
    version = data["manifest_version"]
    if type(version) is not int or version != MANIFEST_VERSION:  # `type`: true == 1 and 1.0 == 1 in Python
        newer = type(version) is int and version > MANIFEST_VERSION
        raise PackageError(
            f"{path}: manifest_version {json.dumps(version)} is not one this neuropod reads: it reads "
            f"manifest_version {MANIFEST_VERSION} only. "
            + ("The package was written by a newer neuropod: upgrade neuropod to read it."
               if newer else "The manifest is damaged: rebuild the package.")
        )
    files = data.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise PackageError(f"{path}: 'files' must map each package file to its sha256; expected {expected}")
    return dict(files)


def _verify_manifest(
    root: Path, manifest: Mapping[str, str], source: Path, files: Collection[str], hashes: Mapping[str, str] | None
) -> None:
    present = set(files) - {MANIFEST}
    missing = sorted(set(manifest) - present)
    extra = sorted(present - set(manifest))

    def digest(rel: str) -> str:
        # An extracted zip's hashes were taken from the zip's bytes as they were written.
        return hashes[rel] if hashes is not None else cache.sha256_file(root / rel)

    changed = sorted(f for f in set(manifest) & present if digest(f) != manifest[f])
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


def _original_json(data: Mapping[str, Any]) -> str:
    """``config.json`` and ``manifest.json`` text as the original Neuropod wrote them.

    Its packagers wrote both with ``json.dump(..., indent=4, sort_keys=True)``:
    keys sorted, four-space indent, ``", "``/``": "`` separators, ASCII escapes
    and no final newline. Writing the same bytes means a package made here from
    the same inputs differs from the original's only by what we add
    (``exported_with``, test data as ``.npz``), so diffs and hashes of the two
    line up.
    """
    return json.dumps(data, indent=4, sort_keys=True)


def make_manifest(root: Path, known: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The manifest of every file under ``root`` except the manifest itself.

    :param known: sha256 already taken of some files (by relative path), for
        instance while they were copied in; the others are read and hashed.
    """
    known = known or {}
    return {
        "manifest_version": MANIFEST_VERSION,
        "files": {f: known.get(f) or cache.sha256_file(root / f) for f in _list_files(root) if f != MANIFEST},
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
                arr = _string_test_tensor(name, arr, path)
            buf = io.BytesIO()
            # Not np.ascontiguousarray: it makes a 0-d array (a scalar) 1-d.
            np.lib.format.write_array(buf, arr if arr.flags.c_contiguous else arr.copy(order="C"), allow_pickle=False)
            zf.writestr(_zip_info(f"{name}.npy"), buf.getvalue())


def _string_test_tensor(name: str, arr: np.ndarray, path: Path) -> np.ndarray:
    """A string test tensor as numpy unicode, refusing what that cannot hold exactly.

    Test data stays plain ``.npz`` that ``numpy.load`` reads without pickle,
    and numpy's only such string dtype is fixed-width unicode, padded with
    NULs: it keeps a NUL inside a string but cannot hold a trailing one
    ("c\\0" reads back as "c"). Storing strings some other way would make
    test data that numpy and older neuropods misread without a word, so a
    string that would not come back byte for byte is refused instead.
    (A unicode or bytes array given by the caller has lost its trailing NULs
    already, in numpy; only object arrays can still hold them.)
    """
    for index, value in np.ndenumerate(arr):
        where = f"Test tensor {name!r} for {path.name}, element {list(index)}"
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PackageError(f"{where} is bytes that are not UTF-8 text ({e}); string tensors hold text") from None
        if isinstance(value, str) and value.endswith("\0"):
            raise PackageError(
                f"{where} ends with a NUL character, which .npz test data cannot store (numpy pads strings "
                "with NULs and drops trailing ones). Leave that element out of the bundled test data, or end it "
                "with another character."
            )
    return to_string_array(arr)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with cache.open_regular(path) as f, np.load(f, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except PackageError as e:
        raise PackageError(f"Cannot read test data: {e}") from None
    except cache.ZIP_READ_ERRORS as e:  # a damaged member surfaces as zlib.error, EOFError, ...
        raise PackageError(f"Cannot read test data {path}: {type(e).__name__}: {e}") from None


def _read_legacy_pickle(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    try:
        with cache.open_regular(path) as f:
            # Neuropod 0.3 wrote these from Python 2: latin1 restores numpy's buffers.
            data = pickle.load(f, encoding="latin1")  # noqa: S301 - the caller said it trusts the package
    except Exception as e:  # anything can fail inside an unpickler
        raise PackageError(f"Cannot read legacy test data {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("test_input"), dict):
        raise PackageError(f"{path}: expected a dict with 'test_input' (and optionally 'test_output')")
    expected = data.get("test_output")
    return dict(data["test_input"]), (dict(expected) if isinstance(expected, dict) else None)


# --- writing --------------------------------------------------------------


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
    persist_test_data: bool = True,
    zip_compression: int = zipfile.ZIP_DEFLATED,
) -> Path:
    """Write a package; the building block of every ``create_*_neuropod``.

    Files are streamed: each is copied in chunks and hashed for the manifest
    as it is copied, and zipped in chunks, so writing a model file of any size
    holds only a chunk of it in memory.

    :param neuropod_path: where to write: a directory, or a zip file when
        ``package_as_zip``. It must not exist yet.
    :param config: what goes into ``config.json``; ``custom_ops`` is filled
        in from the libraries given here.
    :param files: package-relative path (e.g. ``"0/data/model.onnx"``) to a
        file or directory to copy, or the bytes to write.
    :param backend_config: written to ``0/config.json`` when given.
    :param custom_ops: custom-op libraries to copy into ``0/ops/``.
    :param persist_test_data: store ``test_input_data`` / ``test_expected_out``
        in the package (the original Neuropod's keyword); False leaves them out.
    :param zip_compression: with ``package_as_zip``, how members are
        compressed: ``zipfile.ZIP_DEFLATED`` (default) or ``zipfile.ZIP_STORED``
        (the original Neuropod's keyword; stored is faster to write and read
        for models that do not compress).
    :returns: the path written.
    """
    check_flag("package_as_zip", package_as_zip)
    check_flag("persist_test_data", persist_test_data)
    if zip_compression not in _ZIP_COMPRESSIONS or isinstance(zip_compression, bool):
        raise ValueError(
            f"zip_compression must be zipfile.ZIP_DEFLATED ({zipfile.ZIP_DEFLATED}) or zipfile.ZIP_STORED "
            f"({zipfile.ZIP_STORED}), not {zip_compression!r:.60}"
        )
    dest = Path(neuropod_path)
    if config.exported_with is None:  # what tells our packages from the original Neuropod's
        config = replace(config, exported_with={"neuropod": __version__})
    # Check the config as a reader will see it before writing anything.
    config = parse_config(json.loads(json.dumps(config.to_dict())), f"config of {dest}")
    if os.path.lexists(dest):
        raise _exists(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".neuropod-", dir=dest.parent))
    hashes: dict[str, str] = {}  # taken while copying: each model file is read once
    try:
        op_names = []
        for op in custom_ops:
            op_path = Path(op)
            if not op_path.is_file():
                raise PackageError(f"Custom op library {op_path} does not exist")
            if op_path.name in op_names:
                raise PackageError(f"Two custom op libraries are named {op_path.name!r}; rename one")
            _copy_into(staging, f"0/ops/{op_path.name}", op_path, hashes)
            op_names.append(op_path.name)
        for rel, src in files.items():
            _copy_into(staging, rel, src, hashes)
        if backend_config is not None:
            _write_text(staging / "0" / CONFIG, json.dumps(dict(backend_config), indent=2, sort_keys=True) + "\n")
        config = replace(config, custom_ops=tuple(op_names))
        _write_text(staging / CONFIG, _original_json(config.to_dict()))
        if test_input_data is not None and persist_test_data:
            _write_npz(staging / TEST_INPUTS, test_input_data)
            if test_expected_out is not None:
                _write_npz(staging / TEST_EXPECTED, test_expected_out)
        _write_text(staging / MANIFEST, _original_json(make_manifest(staging, hashes)))
        if package_as_zip:
            _write_zip(staging, dest, replace=False, compression=zip_compression)
        else:
            staging.chmod(0o755)  # mkdtemp made it private; a package is meant to be shared
            try:
                staging.rename(dest)
            except OSError as e:  # another writer got there first: its package is complete, leave it
                if os.path.lexists(dest):
                    raise _exists(dest) from None
                raise PackageError(f"Cannot write package {dest}: {e.strerror}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def replace_package(new: Path, dest: Path) -> None:
    """Put the complete package ``new`` at ``dest`` in place of the one there, by renames on one file system.

    ``dest`` names the old package until the new one takes its name; if that
    fails, the old one is put back.

    :raises PackageError: a rename failed (the old package is kept).
    """
    if new.is_file() and dest.is_file() and not dest.is_symlink():
        try:
            os.replace(new, dest)  # one atomic step: a zip for a zip
        except OSError as e:
            raise PackageError(f"Cannot replace {dest}: {e.strerror}") from None
        return
    trash = Path(tempfile.mkdtemp(prefix=".neuropod-old-", dir=dest.parent))
    old = trash / "old"
    try:
        os.rename(dest, old)
    except OSError as e:
        shutil.rmtree(trash, ignore_errors=True)
        raise PackageError(f"Cannot replace {dest}: {e.strerror}") from None
    try:
        os.rename(new, dest)
    except OSError as e:
        try:
            os.rename(old, dest)
        except OSError:
            raise PackageError(f"Cannot replace {dest}: {e.strerror}; the old package is at {old}") from None
        shutil.rmtree(trash, ignore_errors=True)
        raise PackageError(f"Cannot replace {dest}: {e.strerror}") from None
    shutil.rmtree(trash, ignore_errors=True)


def _exists(dest: Path) -> PackageError:
    return PackageError(f"{dest} already exists; choose a new path or remove it first")


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _copy_into(root: Path, rel: str, src: FileSource, hashes: dict[str, str]) -> None:
    """Copy ``src`` to ``root/rel``, recording the sha256 of each file written in ``hashes``."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise PackageError(f"Package file path {rel!r} must be relative and stay inside the package")
    target = root.joinpath(*parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(src, bytes):
        target.write_bytes(src)
        hashes[PurePosixPath(*parts).as_posix()] = hashlib.sha256(src).hexdigest()
        return
    src_path = Path(src)

    def copy(src_file: str, dst_file: str) -> None:
        hashes[Path(dst_file).relative_to(root).as_posix()] = _copy_regular(src_file, dst_file)

    if src_path.is_dir():
        shutil.copytree(src_path, target, symlinks=False, copy_function=copy)
    elif os.path.lexists(src_path):
        copy(str(src_path), str(target))
    else:
        raise PackageError(f"Cannot package {src_path}: no such file or directory")


def _copy_regular(src: str, dst: str) -> str:
    """Copy one file in chunks and return its sha256 (of the bytes written)."""
    # Links are followed (a source tree may be built from them), but what they
    # lead to must be a file: copying a FIFO or /dev/zero would never end.
    try:
        mode = os.stat(src).st_mode
    except OSError as e:
        raise PackageError(f"Cannot package {src}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise PackageError(f"Cannot package {src}: it is {cache.file_kind(mode)}, not a regular file")
    with cache.open_regular(Path(src)) as f, open(dst, "wb") as out:
        try:
            return cache.hash_stream(f, copy_to=out)
        except OSError as e:
            raise PackageError(f"Cannot package {src}: {e.strerror}") from None


def _zip_info(name: str, compression: int = zipfile.ZIP_DEFLATED) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    info.compress_type = compression
    info.create_system = 3  # unix, so the permission bits below mean the same everywhere
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


def write_zip(root: Path, dest: Path, *, compression: int = zipfile.ZIP_DEFLATED) -> None:
    """Zip a package directory deterministically: same files, same bytes. ``dest`` is replaced."""
    _write_zip(root, dest, replace=True, compression=compression)


def _write_zip(root: Path, dest: Path, *, replace: bool, compression: int = zipfile.ZIP_DEFLATED) -> None:
    # A temporary name of our own, not "<dest>.partial": two writers of one
    # path would write into one file and rename each other's half-zips.
    while True:
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.partial")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise PackageError(f"Cannot write {dest}: {e.strerror}") from None
    try:
        with open(fd, "wb") as out:
            with zipfile.ZipFile(out, "w") as zf:
                for rel in _list_files(root):
                    with cache.open_regular(root / rel) as f:
                        info = _zip_info(rel, compression)
                        # The size up front lets zipfile pick ZIP64 headers only for members that need them.
                        info.file_size = os.fstat(f.fileno()).st_size
                        with zf.open(info, "w") as member:
                            shutil.copyfileobj(f, member, _ZIP_CHUNK)
            out.flush()
            os.fsync(out.fileno())  # complete on disk before it appears under its name
        if replace:
            os.replace(tmp, dest)
        else:
            _link_new(tmp, dest)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _link_new(tmp: Path, dest: Path) -> None:
    """Give ``tmp`` the name ``dest`` only if nothing has it: the loser of a race gets "already exists"."""
    try:
        os.link(tmp, dest)
        return
    except FileExistsError:
        raise _exists(dest) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise PackageError(f"Cannot write {dest}: {e.strerror}") from None
    # A filesystem without hard links: check, then rename (a narrow race remains there).
    if os.path.lexists(dest):
        raise _exists(dest)
    os.replace(tmp, dest)


# --- the extraction cache -----------------------------------------------------


def extract_zip(source: Path, *, max_bytes: int | None = None, max_files: int | None = None) -> Path:
    """Extract a zip package into the cache, once per content hash.

    :returns: the package root inside the cache.
    :raises PackageError: the zip is unreadable, damaged, unsafe, over a limit
        or not a package.
    """
    cache.check_limit_argument("max_bytes", max_bytes)
    cache.check_limit_argument("max_files", max_files)
    source = Path(source)
    entry = cache.extract(
        source,
        max_bytes=cache.max_package_bytes() if max_bytes is None else max_bytes,
        max_files=cache.max_package_files() if max_files is None else max_files,
        check=lambda extracted, records: _zip_root(extracted, records, source),
    )
    return _zip_root(entry.path, entry.files, source)[0]


__all__ = [
    "DEFAULT_MAX_PACKAGE_BYTES",
    "DEFAULT_MAX_PACKAGE_FILES",
    "ModelConfig",
    "Package",
    "cache_dir",
    "extract_zip",
    "verify_cache",
    "make_manifest",
    "parse_config",
    "read_package",
    "write_package",
    "replace_package",
    "write_zip",
]
