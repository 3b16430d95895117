"""Writing a package for a packager: :func:`create_package`, the common keywords every
``create_<platform>_neuropod`` takes (:class:`PackageOptions`), and the check of the new package.

A packager turns its model into files; :func:`create_package` writes them in the package format
(:func:`neuropod.package.write_package`) and loads the new package once to run its test data
(:func:`neuropod.testdata.check_packaged`), so it sits above the loader.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from neuropod._args import check_flag
from neuropod._version import __version__
from neuropod.backend import installed_distribution
from neuropod.errors import PackageError
from neuropod.package import CONFIG, FileSource, ModelConfig, parse_output_labels, replace_package, write_package
from neuropod.pipespec import PipelineSpec
from neuropod.spec import TensorSpec, parse_spec
from neuropod.statespec import STATE_DIR, ZERO, parse_sequence_controls, parse_state_spec
from neuropod.testdata import check_packaged


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
    output_labels: Mapping[str, Sequence[str]] | None = None,
    decoupled: bool = False,
    state_spec: Iterable[Mapping[str, Any]] | None = None,
    sequence_controls: Iterable[Mapping[str, Any]] | None = None,
    pipeline: PipelineSpec | None = None,
) -> ModelConfig:
    """The ``config.json`` every ``create_*_neuropod`` writes, from its usual arguments.

    Records the neuropod version and the first of ``framework_distributions``
    that is installed (its name and exact version) as ``exported_with``;
    inputs not in ``input_tensor_device`` get ``default_input_tensor_device``,
    as in the original Neuropod's packagers. ``state_spec`` entries' initial states must be
    ``"zero"`` or ``{"data_file": ...}`` here (see :func:`state_files` for arrays).
    """
    check_flag("decoupled", decoupled)
    inputs = parse_spec(input_spec, "input_spec")
    devices = {s.name: default_input_tensor_device for s in inputs}
    devices.update(input_tensor_device or {})
    made: dict[str, Any] = {"neuropod": __version__}
    found = installed_distribution(*framework_distributions) if framework_distributions else None
    if found:
        made.update(framework=found[0], platform_version=found[1])
    made.update(exported_with or {})
    outputs = parse_spec(output_spec, "output_spec")
    return ModelConfig(
        name=model_name,
        platform=platform,
        platform_version_semver=platform_version_semver,
        input_spec=inputs,
        output_spec=outputs,
        input_tensor_device=devices,
        exported_with=made,
        device_requirements=device_requirements,
        output_labels=parse_output_labels(output_labels, outputs, "output_labels"),
        decoupled=bool(decoupled),
        state_spec=parse_state_spec(state_spec, inputs, outputs, "state_spec"),
        sequence_controls=parse_sequence_controls(sequence_controls, inputs, "sequence_controls"),
        pipeline=pipeline,
    )


class PackageOptions(TypedDict, total=False):
    """The keywords every ``create_*_neuropod`` takes besides its model: the original Neuropod's common ones.

    A packager takes them as ``**options: Unpack[PackageOptions]`` and hands
    them to :func:`create_package`, which checks them; each packager's
    docstring says only what is its own.

    * ``platform_version_semver``: the framework versions the model works
      with, an npm-style or PEP 440 range (default: the packager's, often
      ``"*"``; a format tied to a framework release defaults to what that
      framework promises to load).
    * ``custom_ops``: custom-op shared libraries, copied into ``0/ops/`` and
      loaded by the backend before the model.
    * ``input_tensor_device``: input name to ``"CPU"``/``"GPU"``; inputs not
      named get ``default_input_tensor_device`` (default ``"GPU"``). A GPU
      entry makes the model prefer a GPU when one fits, and ``"CPU"`` inputs
      stay on the CPU, as in the original Neuropod.
    * ``test_input_data``: inputs stored as test data; the new package is
      loaded and run on them before the packager returns, and with
      ``test_expected_out`` its outputs must match within ``test_rtol`` /
      ``test_atol``. A package that fails is removed (a ``PackageError``,
      also the ``ValueError`` the original raised).
    * ``persist_test_data``: store the test data in the package (default);
      False checks the new package with it without storing it.
    * ``package_as_zip``: write a zip instead of a directory;
      ``zip_compression`` is ``zipfile.ZIP_DEFLATED`` (default) or
      ``zipfile.ZIP_STORED``.
    * ``neuropod_load_args``: keywords for the ``load_neuropod`` that checks
      the new package, e.g. ``{"use_ope": True}``.
    * ``output_labels``: output name to its class labels, label ``i`` for
      index ``i`` of a row of that output; kept in ``config.json`` and used by
      ``neuropod serve`` to answer classification requests
      (``score:index:label``).
    * ``decoupled``: the model answers each request with any number of
      responses (zero or more), each a dict of some or all of its outputs;
      it runs with ``infer_stream``, and only on a backend that streams
      (the python backend: the model's function is a generator). Kept in
      ``config.json`` as ``"decoupled": true``.
    * ``state_spec``: the state a stateful model carries from one request of
      a sequence to the next: a list of ``{"input_name", "output_name",
      "dtype", "shape", "initial_state"}``, output ``output_name`` of one step
      being input ``input_name`` of the next. Both are ordinary tensors of the
      specs, which callers never send or see. ``shape`` is one sequence's
      state (default: the input's, a leading batch symbol as 1), ``dtype``
      the input's by default; ``initial_state`` is ``"zero"`` (default) or an
      array, stored in the package. The model runs in sequences
      (``model.sequence()``).
    * ``sequence_controls``: inputs the runtime fills on each step, a list of
      ``{"name": input, "kind": ...}`` with kinds ``CONTROL_SEQUENCE_START``,
      ``CONTROL_SEQUENCE_READY``, ``CONTROL_SEQUENCE_END`` (1 or 0 in the
      input's dtype) and ``CONTROL_SEQUENCE_CORRID`` (the sequence's id), as
      Triton's ``control_input``.
    * ``overwrite``: replace a package already at the path (default False:
      that is an error). The new package is written and checked beside the
      old one, which is replaced only then; a package that fails its check
      leaves the old one as it was. Only a package (a directory with a
      ``config.json``, or a zip file) is ever replaced.
    """

    platform_version_semver: str
    custom_ops: Sequence[str | os.PathLike[str]]
    input_tensor_device: Mapping[str, str] | None
    default_input_tensor_device: str
    test_input_data: Mapping[str, Any] | None
    test_expected_out: Mapping[str, Any] | None
    package_as_zip: bool
    persist_test_data: bool
    zip_compression: int
    neuropod_load_args: Mapping[str, Any] | None
    output_labels: Mapping[str, Sequence[str]] | None
    test_rtol: float
    test_atol: float
    overwrite: bool
    decoupled: bool
    state_spec: Sequence[Mapping[str, Any]] | None
    sequence_controls: Sequence[Mapping[str, Any]] | None


_OPTION_DEFAULTS: dict[str, Any] = {
    "custom_ops": (),
    "input_tensor_device": None,
    "default_input_tensor_device": "GPU",
    "test_input_data": None,
    "test_expected_out": None,
    "package_as_zip": False,
    "persist_test_data": True,
    "zip_compression": zipfile.ZIP_DEFLATED,
    "neuropod_load_args": None,
    "output_labels": None,
    "test_rtol": 1e-5,
    "test_atol": 1e-6,
    "overwrite": False,
    "decoupled": False,
    "state_spec": None,
    "sequence_controls": None,
}


def package_options(packager: str, options: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``options`` checked against :class:`PackageOptions`, with every one not given at its default.

    For a packager that needs an option (``test_input_data``, ``custom_ops``)
    before it calls :func:`create_package`.

    :param packager: the packager's name, for the error.
    :param defaults: the packager's own defaults, where they differ (e.g.
        ``{"test_rtol": 1e-3}``).
    :raises TypeError: an option that is not one of :class:`PackageOptions`,
        as Python says it of a function's unknown keyword.
    """
    known = PackageOptions.__annotations__
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(
            f"{packager}() got an unexpected keyword argument {unknown[0]!r} (its common keywords are "
            f"{', '.join(known)})"
        )
    return {**_OPTION_DEFAULTS, **(defaults or {}), **options}


def create_package(
    packager: str,
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    platform: str,
    input_spec: Iterable[Mapping[str, Any]] | Iterable[TensorSpec],
    output_spec: Iterable[Mapping[str, Any]] | Iterable[TensorSpec],
    files: Mapping[str, FileSource],
    options: Mapping[str, Any],
    *,
    backend_config: Mapping[str, Any] | None = None,
    framework_distributions: Iterable[str] = (),
    exported_with: Mapping[str, Any] | None = None,
    device_requirements: Mapping[str, Any] | None = None,
    default_version_range: str = "*",
    defaults: Mapping[str, Any] | None = None,
    pipeline: PipelineSpec | None = None,
) -> Path:
    """Write a package and check it: everything a ``create_*_neuropod`` does after its framework's part.

    A packager turns its model into files, then hands them here with the
    caller's common keywords (``options``, see :class:`PackageOptions`).
    This writes the config, the files, the custom ops and the test data
    (:func:`write_package`), then loads the new package once and runs its
    test data (:func:`neuropod.testdata.check_packaged`); a package that does
    not load or does not reproduce its expected outputs is removed and the
    error raised.

    :param packager: the packager's name, for errors (``"create_onnx_neuropod"``).
    :param platform: the package's platform, the name backends answer to.
    :param files: package-relative path (``"0/data/model.onnx"``) to the
        bytes to write, or a file or directory to copy.
    :param options: the caller's common keywords (:class:`PackageOptions`).
    :param backend_config: written to ``0/config.json`` when given.
    :param framework_distributions: the framework's distribution names; the
        first one installed is recorded, with its version, in ``exported_with``.
    :param exported_with: more facts for ``exported_with`` (the release a
        model was compiled with, when it is not the installed one).
    :param device_requirements: what the model needs of a device (e.g. a
        CUDA GPU, a compute capability); resolution reads them.
    :param default_version_range: ``platform_version_semver`` when the
        caller gives none.
    :param defaults: the packager's own defaults for common keywords.
    :param pipeline: a pipeline package's steps (``platform`` is then ``"pipeline"``; see
        :func:`neuropod.create_pipeline.create_pipeline_neuropod`).
    :returns: the path written.
    """
    opts = package_options(packager, options, defaults)
    dest = Path(neuropod_path)
    staging: Path | None = None
    if check_destination(packager, dest, opts):
        # Beside the old one (one file system, so the swap is a rename), under the same name.
        staging = Path(tempfile.mkdtemp(prefix=".neuropod-new-", dir=dest.parent))
    version_range = opts.get("platform_version_semver")
    state_spec, state_data = state_files(opts["state_spec"])
    if state_data:
        files = {**files, **state_data}
    config = packager_config(
        model_name, platform, input_spec, output_spec,
        platform_version_semver=default_version_range if version_range is None else version_range,
        framework_distributions=framework_distributions, input_tensor_device=opts["input_tensor_device"],
        default_input_tensor_device=opts["default_input_tensor_device"], device_requirements=device_requirements,
        exported_with=exported_with, output_labels=opts["output_labels"], decoupled=opts["decoupled"],
        state_spec=state_spec, sequence_controls=opts["sequence_controls"], pipeline=pipeline,
    )  # fmt: skip
    try:
        path = write_package(
            dest if staging is None else staging / dest.name, config, files, backend_config=backend_config,
            custom_ops=opts["custom_ops"], test_input_data=opts["test_input_data"],
            test_expected_out=opts["test_expected_out"], package_as_zip=opts["package_as_zip"],
            persist_test_data=opts["persist_test_data"], zip_compression=opts["zip_compression"],
        )  # fmt: skip
        # Loads the package once (a spec that does not fit the model fails now, not
        # at deployment) and runs the test data; a package that fails is removed.
        check_packaged(
            path, test_input_data=opts["test_input_data"], test_expected_out=opts["test_expected_out"],
            neuropod_load_args=opts["neuropod_load_args"], backend=platform, rtol=opts["test_rtol"],
            atol=opts["test_atol"],
        )  # fmt: skip
        if staging is not None:
            replace_package(path, dest)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def state_files(state_spec: Any) -> tuple[Any, dict[str, bytes]]:
    """``state_spec`` as a packager takes it, with each initial state given as an array made a
    ``{"data_file": "0/state/initial_<i>.npy"}`` entry, and those files' bytes.

    :raises PackageError: an initial state that is neither ``"zero"``, a data file nor an array.
    """
    if state_spec is None or isinstance(state_spec, (str, bytes, Mapping)):
        return state_spec, {}  # parse_state_spec says what is wrong
    entries: list[Any] = []
    data: dict[str, bytes] = {}
    for i, entry in enumerate(state_spec):
        initial = entry.get("initial_state", ZERO) if isinstance(entry, Mapping) else ZERO
        if isinstance(initial, (Mapping, str)):
            entries.append(entry)
            continue
        try:
            array = np.asarray(initial)
        except Exception as e:  # noqa: BLE001 - what the caller passed is not an array
            raise PackageError(f"state_spec[{i}]: initial_state must be \"zero\" or an array ({e})") from None
        if array.dtype.kind in "OUSV":
            raise PackageError(f"state_spec[{i}]: an initial_state array must be numeric, not {array.dtype}")
        name = f"{STATE_DIR}/initial_{i}.npy"
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
        data[name] = buffer.getvalue()
        entries.append({"shape": list(array.shape), **entry, "initial_state": {"data_file": name}})
    return entries, data


def check_destination(packager: str, neuropod_path: str | os.PathLike[str], options: Mapping[str, Any]) -> bool:
    """Whether packaging to ``neuropod_path`` replaces a package there (``overwrite=True``).

    :func:`create_package` checks this; a packager with slow work before it
    (resolving requirements, compiling) can call it first to fail early.

    :raises PackageError: something is there and ``overwrite`` is not set, or it is not a package.
    """
    overwrite = options.get("overwrite", False)
    check_flag("overwrite", overwrite)
    dest = Path(neuropod_path)
    if not os.path.lexists(dest):
        return False
    if not overwrite:
        raise PackageError(
            f"{dest} already exists: pass overwrite=True to {packager}() to replace it (the old package "
            "stays until the new one is written and checked), or choose another path"
        )
    _check_replaceable(dest)
    return True


def _check_replaceable(dest: Path) -> None:
    """Refuse to replace anything but a package: ``overwrite=True`` with a wrong path must not delete a home directory."""
    if dest.is_dir() and (dest / CONFIG).is_file():
        return
    if dest.is_file() and zipfile.is_zipfile(dest):
        return
    raise PackageError(
        f"{dest} exists and is not a Neuropod package (a directory with {CONFIG}, or a zip file); "
        "overwrite=True replaces only a package: remove it yourself or choose another path"
    )


__all__ = ["PackageOptions", "check_destination", "create_package", "package_options", "packager_config"]
