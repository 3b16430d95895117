"""A package's test data: run it and compare with the expected outputs (``neuropod test``), and the
check every packager makes of the package it has just written (:func:`check_packaged`).

(Not named ``test_*.py``, so that pytest never takes it for a test module.)
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neuropod._args import check_flag
from neuropod.errors import NeuropodError, PackageError
from neuropod.loader import LOAD_ARGS, check_load_args, load_neuropod, plan
from neuropod.package import Package, read_package
from neuropod.sequences import StateMismatchError
from neuropod.spec import DTYPES
from neuropod.strings import blank


@dataclass(frozen=True)
class TestReport:
    """The outcome of running a package's bundled test data."""

    model: str
    backend: str
    device: str
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray] | None
    mismatches: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.mismatches


def compare_outputs(
    outputs: Mapping[str, np.ndarray], expected: Mapping[str, Any], *, rtol: float = 1e-5, atol: float = 1e-6
) -> list[str]:
    """Describe every way ``outputs`` differ from ``expected`` (empty when they match)."""
    problems = []
    for name, want in expected.items():
        if name not in outputs:
            problems.append(f"output {name!r} is missing")
            continue
        got, want = np.asarray(outputs[name]), np.asarray(want)
        if got.shape != want.shape:
            problems.append(f"output {name!r} has shape {got.shape}, expected {want.shape}")
        elif _holds_bytes(got) or _holds_bytes(want):  # a bytes tensor: compared byte for byte
            if got.tolist() != want.tolist():
                problems.append(f"output {name!r} is {got.tolist()!r:.200}, expected {want.tolist()!r:.200}")
        elif got.dtype.kind in "UOS" or want.dtype.kind in "UOS":
            if got.astype(str).tolist() != want.astype(str).tolist():
                problems.append(f"output {name!r} is {got.tolist()!r:.200}, expected {want.tolist()!r:.200}")
        elif not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            diff = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))
            problems.append(f"output {name!r} differs from the expected values (max abs difference {diff:.3g})")
    return problems


def _holds_bytes(arr: np.ndarray) -> bool:
    return arr.dtype.kind == "O" and any(isinstance(v, bytes) for v in arr.flat)


def run_test_data(
    neuropod_path: str | os.PathLike[str] | Package,
    *,
    trust_pickle: bool = False,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **load_kwargs: Any,
) -> TestReport:
    """Load a package (a path, or a :class:`Package` already read), run its bundled test inputs and
    compare with the expected outputs."""
    verify = load_kwargs.pop("verify", True)
    check_flag("trust_pickle", trust_pickle)
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)
    check_load_args(neuropod_path, verify=verify, **{k: v for k, v in load_kwargs.items() if k in LOAD_ARGS})
    package = neuropod_path if isinstance(neuropod_path, Package) else read_package(neuropod_path, verify=verify)
    # Read the test data first: a refused pickle should not wait for a backend.
    inputs, expected = package.test_data(trust_pickle=trust_pickle)
    return _run_and_compare(package, inputs, expected, rtol=rtol, atol=atol, load_kwargs=load_kwargs)


def _run_and_compare(
    package: Package, inputs: Mapping[str, Any], expected: Mapping[str, Any] | None, *, rtol: float, atol: float,
    load_kwargs: Mapping[str, Any],
) -> TestReport:  # fmt: skip
    with load_neuropod(package, **load_kwargs) as model:
        if model.decoupled:
            outputs = joined_responses(model, inputs)
        elif model.stateful:  # one step of a new sequence, from the initial state
            with model.sequence() as sequence:
                outputs = sequence.infer(inputs)
        else:
            outputs = model.infer(inputs)
        mismatches = compare_outputs(outputs, expected, rtol=rtol, atol=atol) if expected is not None else []
        return TestReport(
            model.name, model.backend.id, model.device, dict(inputs), outputs,
            None if expected is None else dict(expected), tuple(mismatches),
        )  # fmt: skip


def joined_responses(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A decoupled model's responses to ``inputs`` as one set of outputs, what its test data's
    expected outputs hold: each output's arrays from every response that has it, joined along
    their first axis (a 0-d output's values make a 1-d array); outputs no response held are absent."""
    gathered: dict[str, list[Any]] = {}
    with model.infer_stream(inputs) as responses:
        for response in responses:
            for name, value in response.items():
                gathered.setdefault(name, []).append(np.atleast_1d(value))
    return {name: np.concatenate(parts) for name, parts in gathered.items()}


def check_packaged(
    neuropod_path: str | os.PathLike[str],
    *,
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    neuropod_load_args: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> TestReport | None:
    """For packagers: load a new package once and run its test data.

    The test data is the package's own (what ``persist_test_data`` stored),
    else ``test_input_data`` / ``test_expected_out`` as given. With inputs,
    the model runs once on them; with expected outputs too, its outputs must
    match. A package that cannot load (say, a spec that does not fit the
    model), fails on its test inputs or does not reproduce its expected
    outputs is removed, so nobody deploys it by mistake, and the error is
    raised: the loader's or the model's own (a :class:`SpecError`,
    :class:`BackendError`, ...), or a :class:`PackageError` (also a
    ``ValueError``, as the original Neuropod raised) for outputs that differ
    from the expected ones. Without expected outputs, a package that no backend here can
    run (made for another framework version) is kept with a warning that it
    was not checked.

    :param neuropod_load_args: more keywords for :func:`~neuropod.load_neuropod` (the
        original Neuropod's packager keyword), e.g. ``{"visible_gpu": None}``.
    :param kwargs: for :func:`~neuropod.load_neuropod` (e.g. ``backend=``), plus
        ``rtol``/``atol`` for the comparison.
    :returns: the test report, or None when nothing was run.
    """
    rtol, atol = kwargs.pop("rtol", 1e-5), kwargs.pop("atol", 1e-6)
    if neuropod_load_args is not None:
        if not isinstance(neuropod_load_args, Mapping):
            raise TypeError(f"neuropod_load_args must be a dict of load_neuropod keywords, not {type(neuropod_load_args).__name__}")
        kwargs.update(neuropod_load_args)
    try:
        package = read_package(neuropod_path)
        inputs: Mapping[str, Any] | None = test_input_data
        expected: Mapping[str, Any] | None = test_expected_out if test_input_data is not None else None
        if package.has_test_data:
            inputs, expected = package.test_data()
        if expected is None:
            resolution = plan(package, device=kwargs.get("device"), backend=kwargs.get("backend"))
            if resolution.chosen is None:
                # Packaging for a framework version this machine does not have is
                # legitimate; say that the package was not tried rather than fail.
                warnings.warn(
                    f"Package {package.source} was not checked by loading it: no installed backend can run it "
                    f"here ({resolution.advice()})",
                    UserWarning,
                    stacklevel=3,
                )
                return None
        if inputs is None:
            with load_neuropod(package, **kwargs) as model:
                if model.stateful:
                    check_state_outputs(model)
            return None
        report = _run_and_compare(package, inputs, expected, rtol=rtol, atol=atol, load_kwargs=kwargs)
        if not report.passed:
            raise PackageError(
                f"The new package for model {report.model!r} does not reproduce its expected test output "
                f"with {report.backend} on {report.device}: " + "; ".join(report.mismatches)
                + ". The package was not kept."
            )
        return report
    except BaseException:
        _remove(Path(neuropod_path))
        raise


def check_state_outputs(model: Any) -> None:
    """Run one step of a new sequence of a stateful model on zeros (each symbol and ``None`` dim
    of its inputs as 1), so that a state output that does not fit its ``state_spec`` fails at
    packaging. A model that fails on such inputs for another reason is kept, with a warning that
    its state was not checked.

    :raises StateMismatchError: a state output is missing or does not fit.
    """
    zeros: dict[str, Any] = {}
    for spec in model.inputs:
        shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
        dtype = DTYPES[spec.dtype]
        zeros[spec.name] = np.full(shape, blank(spec.dtype), dtype=object) if dtype is None else np.zeros(shape, dtype=dtype)
    try:
        with model.sequence() as sequence:
            sequence.infer(zeros)
    except StateMismatchError:
        raise
    except NeuropodError as e:
        warnings.warn(
            f"The state outputs of model {model.name!r} were not checked at packaging: one step on zero inputs "
            f"failed ({str(e).splitlines()[0]:.200}); pass test_input_data to check them",
            UserWarning,
            stacklevel=4,
        )


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _check_tolerance(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} {value!r:.60}")
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")


__all__ = ["TestReport", "check_packaged", "compare_outputs", "run_test_data"]
