"""Writing a package: :func:`write_package` (files streamed, hashed for the manifest as they are
copied), deterministic zips (:func:`write_zip`), and :func:`replace_package` for ``overwrite``."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from neuropod import cache
from neuropod._args import check_flag
from neuropod._version import __version__
from neuropod.errors import PackageError
from neuropod.package.config import (
    CONFIG,
    MANIFEST,
    MANIFEST_VERSION,
    TEST_EXPECTED,
    TEST_INPUTS,
    ModelConfig,
    parse_config,
)
from neuropod.package.read import BYTES_FIELDS, list_files
from neuropod.strings import to_bytes_array, to_string_array

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)

FileSource = str | os.PathLike[str] | bytes

#: The compressions a package zip may use (what ``zip_compression=`` accepts).
_ZIP_COMPRESSIONS = (zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED)
_ZIP_CHUNK = 1 << 20


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
        "files": {f: known.get(f) or cache.sha256_file(root / f) for f in list_files(root) if f != MANIFEST},
    }


def _write_npz(path: Path, tensors: Mapping[str, Any], bytes_names: Collection[str] = ()) -> None:
    # np.savez stamps the current time into the zip; write members ourselves
    # so that the same data always gives the same bytes.
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(tensors):
            if name in bytes_names:
                arr = _bytes_test_tensor(name, tensors[name], path)
            elif (arr := np.asarray(tensors[name])).dtype.kind in "OS":
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


def _bytes_test_tensor(name: str, values: Any, path: Path) -> np.ndarray:
    """A bytes test tensor as a structured array of fixed-width bytes and lengths, which numpy loads without
    pickle. The lengths restore what the fixed width loses: numpy pads with NUL bytes and drops trailing
    ones, so each element is read back as its stored bytes padded with NULs to its length
    (``package.read`` does; numpy alone shows the fields ``bytes`` and ``length``)."""
    try:
        flat = to_bytes_array(values)
    except TypeError as e:
        raise PackageError(f"Test tensor {name!r} for {path.name} is a bytes tensor: {e}") from None
    items = flat.ravel().tolist()
    width = max((len(b) for b in items), default=0) or 1
    out = np.zeros(flat.shape, dtype=[(BYTES_FIELDS[0], f"S{width}"), (BYTES_FIELDS[1], "<u8")])
    rows = out.reshape(-1)  # a view of the new array, where a field's ravel() would be a copy
    rows[BYTES_FIELDS[0]] = items
    rows[BYTES_FIELDS[1]] = [len(b) for b in items]
    return out


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
            _write_npz(staging / TEST_INPUTS, test_input_data, {s.name for s in config.input_spec if s.dtype == "bytes"})
            if test_expected_out is not None:
                outputs = {s.name for s in config.output_spec if s.dtype == "bytes"}
                _write_npz(staging / TEST_EXPECTED, test_expected_out, outputs)
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
                for rel in list_files(root):
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


__all__ = ["FileSource", "make_manifest", "replace_package", "write_package", "write_zip"]
