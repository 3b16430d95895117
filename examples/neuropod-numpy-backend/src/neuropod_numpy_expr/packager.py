"""``create_numpy_expr_neuropod``: package numpy expressions with their problem spec."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod import __version__ as neuropod_version
from neuropod.backend import installed_distribution
from neuropod.model import check_packaged
from neuropod.package import ModelConfig, write_package
from neuropod.spec import parse_spec
from neuropod_numpy_expr import MODEL_FILE, PLATFORM
from neuropod_numpy_expr.expr import compile_expression


def create_numpy_expr_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    expressions: Mapping[str, str],
    platform_version_semver: str = "*",
    custom_ops: Sequence[str | os.PathLike[str]] = (),
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    package_as_zip: bool = False,
) -> Path:
    """Package numpy expressions as a Neuropod.

    :param expressions: output name to an expression of the inputs, e.g.
        ``{"out": "x + y"}``; checked against the whitelist before writing.
    :param platform_version_semver: the numpy versions it works with.
    :param custom_ops: accepted for the common packager signature; the
        backend refuses to load packages with custom ops.
    :param test_input_data: stored as test data; with ``test_expected_out``
        the package is loaded and checked before this returns.
    :returns: the path written.
    """
    inputs = parse_spec(input_spec, "input_spec")
    outputs = parse_spec(output_spec, "output_spec")
    names = {s.name for s in inputs}
    for out, text in expressions.items():
        compile_expression(text, names, f"output {out!r} of model {model_name!r}")
    found = installed_distribution("numpy")
    exported_with: dict[str, Any] = {"neuropod": neuropod_version}
    if found:
        exported_with.update(framework=found[0], platform_version=found[1])
    config = ModelConfig(
        name=model_name,
        platform=PLATFORM,
        platform_version_semver=platform_version_semver,
        input_spec=inputs,
        output_spec=outputs,
        input_tensor_device={s.name: "CPU" for s in inputs},
        exported_with=exported_with,
    )
    model = json.dumps({"outputs": dict(expressions)}, indent=2) + "\n"
    path = write_package(
        neuropod_path, config, {f"0/data/{MODEL_FILE}": model.encode()}, custom_ops=custom_ops,
        test_input_data=test_input_data, test_expected_out=test_expected_out, package_as_zip=package_as_zip,
    )  # fmt: skip
    check_packaged(path, backend=PLATFORM)
    return path


__all__ = ["create_numpy_expr_neuropod"]
