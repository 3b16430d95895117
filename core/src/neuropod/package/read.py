"""Reading a package: a directory, or a zip extracted once into the cache; its manifest checked, its
test data read (see :mod:`neuropod.package` for what is refused and why)."""

from __future__ import annotations

import json
import os
import pickle
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuropod import _json, cache
from neuropod.errors import PackageError
from neuropod.package.config import (
    CONFIG,
    LEGACY_TEST_DATA,
    MANIFEST,
    MANIFEST_VERSION,
    REQUIREMENTS_LOCK,
    TEST_EXPECTED,
    TEST_INPUTS,
    ModelConfig,
    parse_config,
)


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
        return list_files(self.root)

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


def list_files(root: Path) -> list[str]:
    """Every file under a package root, as sorted package-relative paths (links and special files refused)."""
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


# --- test data ------------------------------------------------------------


#: The fields of a bytes test tensor in ``.npz`` test data: each element's bytes, NUL-padded to a fixed
#: width (numpy drops trailing NULs when it reads them), and its length, which restores them.
BYTES_FIELDS = ("bytes", "length")


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with cache.open_regular(path) as f, np.load(f, allow_pickle=False) as data:
            return {k: _restore_bytes(data[k]) for k in data.files}
    except PackageError as e:
        raise PackageError(f"Cannot read test data: {e}") from None
    except cache.ZIP_READ_ERRORS as e:  # a damaged member surfaces as zlib.error, EOFError, ...
        raise PackageError(f"Cannot read test data {path}: {type(e).__name__}: {e}") from None


def _restore_bytes(arr: np.ndarray) -> np.ndarray:
    """A bytes test tensor (see :data:`BYTES_FIELDS`) as the object array of bytes it was; other arrays as they are."""
    if arr.dtype.names != BYTES_FIELDS:
        return arr
    items = [b.ljust(n, b"\0") for b, n in zip(arr[BYTES_FIELDS[0]].ravel().tolist(), arr[BYTES_FIELDS[1]].ravel().tolist())]
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(arr.shape)


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


__all__ = ["Package", "extract_zip", "list_files", "read_package"]
