"""``create_python_neuropod`` and ``create_pytorch_neuropod``: package Python code as a model.

The layout is the original Neuropod's::

    config.json              name, platform "python", the specs, platform_version_semver (Python versions)
    0/config.json            {"entrypoint": ..., "entrypoint_package": ...}
    0/code/...               the code, from code_path_spec (an __init__.py in every directory)
    0/data/...               the data files, from data_paths
    0/requirements.lock      exact pins (and hashes) of the requirements, when there are any
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.backend import installed_distribution
from neuropod.create import check_destination, create_package, package_options
from neuropod.errors import NeuropodError, PackageError
from neuropod.package import FileSource
from neuropod.versions import parse_range, satisfies
from neuropod_python import PLATFORM, other_interpreters
from neuropod_python.lock import compile_requirements, requirement_names

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions


def create_python_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    data_paths: Sequence[Mapping[str, Any]],
    code_path_spec: Sequence[Mapping[str, Any]],
    entrypoint_package: str,
    entrypoint: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    requirements: str | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package Python code as a Neuropod.

    :param neuropod_path: where to write the package (must not exist unless
        ``overwrite=True``, and must not be inside a ``python_root``).
    :param model_name: the model's name.
    :param data_paths: data files, each ``{"path": "/path/to/file", "packaged_name": "name"}``;
        they go into ``0/data/``, the directory the entrypoint is given.
    :param code_path_spec: the code, each ``{"python_root": "/src", "dirs_to_package": ["pkg", ...]}``
        (``""`` packages the whole root); copied into ``0/code/`` with their
        paths kept, ``*.pyc`` and ``__pycache__`` left out, and an
        ``__init__.py`` added to every directory that has none.
    :param entrypoint_package: the module holding the entrypoint, e.g. ``"my.models.adder"``.
    :param entrypoint: a function of that module: ``entrypoint(data_root)``
        returns a callable that takes the inputs as keyword numpy arrays and
        returns a dict of output name to numpy array.
    :param requirements: pip requirements the code needs (e.g.
        ``"scikit-learn==1.9.1"``). They are resolved now, with pip, into
        exact pins (with sha256 hashes when pip gives them) in
        ``0/requirements.lock``; a loaded package then runs in a worker
        process whose environment is built from that lock, once per lock.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`).
        ``platform_version_semver`` is the Python versions the code works
        with, e.g. ``">=3.10"`` or ``"==3.12.*"``; ``custom_ops`` are Python
        extension modules (``.so`` files) the code imports by name, as the
        original allowed: they go into ``0/ops/``, which is on the import path
        while the code is imported.
    :returns: the path written.
    """
    dest = Path(neuropod_path)
    _check_name("entrypoint_package", entrypoint_package, dotted=True)
    _check_name("entrypoint", entrypoint, dotted=False)
    data = _data_files(data_paths)
    roots = _code_roots(code_path_spec, dest)
    if requirements is not None and not isinstance(requirements, str):
        raise TypeError(f"requirements must be a str in pip's requirements format, not {type(requirements).__name__}")
    opts = package_options("create_python_neuropod", options)
    check_destination("create_python_neuropod", dest, opts)  # before pip resolves the requirements
    version_range = opts.get("platform_version_semver") or "*"
    files: dict[str, FileSource] = {f"0/data/{name}": path for name, path in data.items()}
    # The original's bytes exactly: json.dump with sorted keys, no indent, no newline.
    files["0/config.json"] = json.dumps({"entrypoint": entrypoint, "entrypoint_package": entrypoint_package}, sort_keys=True).encode()
    if requirements is not None and requirement_names(requirements):
        files["0/requirements.lock"] = compile_requirements(requirements, _locking_python(version_range)).encode()
    with tempfile.TemporaryDirectory(prefix="neuropod-code-") as staging:
        code = Path(staging) / "code"
        _stage_code(roots, code)
        files["0/code"] = code
        return create_package(
            "create_python_neuropod", dest, model_name, PLATFORM, input_spec, output_spec, files, options,
            exported_with={"framework": "cpython", "platform_version": platform.python_version()},
        )  # fmt: skip


def create_pytorch_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    data_paths: Sequence[Mapping[str, Any]],
    code_path_spec: Sequence[Mapping[str, Any]],
    entrypoint_package: str,
    entrypoint: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    requirements: str | None = None,
    **kwargs: Any,
) -> Path:
    """Package an eager PyTorch model (Python code around ``torch.nn.Module``\\s) as a Neuropod.

    The same as :func:`create_python_neuropod`, with ``torch`` added to the
    requirements: ``torch==<the version installed here>`` unless the
    requirements already name torch. The package's platform is ``python``,
    as with the original Neuropod. The entrypoint's callable gets numpy
    arrays; it may return torch tensors (they are converted).
    """
    reqs = requirements or ""
    if "torch" not in requirement_names(reqs):
        found = installed_distribution("torch")
        if found is None:
            raise NeuropodError(
                "create_pytorch_neuropod pins the torch the model runs with, but torch is not installed here: "
                "install it, or name it in requirements (e.g. requirements='torch==2.13.0')"
            )
        reqs = f"{reqs.rstrip()}\ntorch=={found[1]}\n".lstrip()
    return create_python_neuropod(
        neuropod_path, model_name, data_paths, code_path_spec, entrypoint_package, entrypoint, input_spec,
        output_spec, requirements=reqs, **kwargs,
    )  # fmt: skip


def _check_name(what: str, value: object, *, dotted: bool) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty str, not {type(value).__name__} {value!r:.60}")
    parts = value.split(".") if dotted else [value]
    if not all(p.isidentifier() for p in parts):
        kind = "a module path such as 'my_models.adder'" if dotted else "a function name such as 'get_model'"
        raise ValueError(f"{what} {value!r} is not {kind}")


def _data_files(data_paths: Any) -> dict[str, Path]:
    if isinstance(data_paths, (str, bytes)) or not isinstance(data_paths, Sequence):
        raise TypeError('data_paths must be a list of {"path": ..., "packaged_name": ...} dicts')
    files: dict[str, Path] = {}
    for i, item in enumerate(data_paths):
        if not isinstance(item, Mapping) or not {"path", "packaged_name"} <= set(item):
            raise ValueError(f'data_paths[{i}] must be a dict with "path" and "packaged_name", not {item!r:.100}')
        src, name = Path(item["path"]), str(item["packaged_name"])
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name.startswith("~"):
            raise ValueError(f"data_paths[{i}]: packaged_name {name!r} must be a relative path inside 0/data")
        if not src.is_file():
            raise PackageError(f"data_paths[{i}]: {src} is not a file")
        if Path(name).as_posix() in files:
            raise ValueError(f"data_paths: two files are packaged as {name!r}")
        files[Path(name).as_posix()] = src
    return files


def _code_roots(code_path_spec: Any, dest: Path) -> list[tuple[Path, str]]:
    if isinstance(code_path_spec, (str, bytes)) or not isinstance(code_path_spec, Sequence):
        raise TypeError('code_path_spec must be a list of {"python_root": ..., "dirs_to_package": [...]} dicts')
    out = []
    target = os.path.realpath(dest)
    for i, item in enumerate(code_path_spec):
        if not isinstance(item, Mapping) or not {"python_root", "dirs_to_package"} <= set(item):
            raise ValueError(f'code_path_spec[{i}] must be a dict with "python_root" and "dirs_to_package", not {item!r:.100}')
        root = Path(item["python_root"])
        if not root.is_dir():
            raise PackageError(f"code_path_spec[{i}]: python_root {root} is not a directory")
        if (target + os.sep).startswith(os.path.realpath(root) + os.sep):
            raise ValueError(f"neuropod_path {dest} cannot be inside python_root {root}: the package would copy itself")
        dirs = item["dirs_to_package"]
        if isinstance(dirs, str) or not isinstance(dirs, Sequence):
            raise TypeError(f"code_path_spec[{i}]['dirs_to_package'] must be a list of directories, not {dirs!r:.100}")
        for d in dirs:
            rel = str(d)
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"code_path_spec[{i}]: {rel!r} must be a directory relative to python_root")
            if not (root / rel).is_dir():
                raise PackageError(f"code_path_spec[{i}]: {root / rel} is not a directory")
            out.append((root, rel))
    return out


def _stage_code(roots: list[tuple[Path, str]], code: Path) -> None:
    code.mkdir()
    for root, rel in roots:
        shutil.copytree(root / rel, code / rel, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"),
                        dirs_exist_ok=True, symlinks=False)  # fmt: skip
    for directory, _, names in os.walk(code):
        if "__init__.py" not in names:
            (Path(directory) / "__init__.py").touch()


def _locking_python(version_range: str) -> str:
    """The interpreter to lock the requirements with: this one when the package's range allows it,
    else the first other interpreter on PATH that it allows."""
    import sys

    parse_range(version_range)  # an invalid range is an error naming it
    if satisfies(platform.python_version(), version_range):
        return sys.executable
    for version, path in other_interpreters():
        if satisfies(version, version_range):
            return path
    raise NeuropodError(
        f"platform_version_semver {version_range!r} allows no Python on this machine (this one is "
        f"{platform.python_version()}; others on PATH: {', '.join(v for v, _ in other_interpreters()) or 'none'}); "
        "the requirements are locked with the Python the model will run on"
    )


__all__ = ["create_python_neuropod", "create_pytorch_neuropod"]
