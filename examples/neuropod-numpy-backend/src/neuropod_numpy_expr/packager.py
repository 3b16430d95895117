"""``create_numpy_expr_neuropod``: package numpy expressions with their problem spec."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.create import create_package
from neuropod.spec import parse_spec
from neuropod_numpy_expr import MODEL_FILE, PLATFORM
from neuropod_numpy_expr.expr import compile_expression

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions


def create_numpy_expr_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    expressions: Mapping[str, str],
    **options: Unpack[PackageOptions],
) -> Path:
    """Package numpy expressions as a Neuropod.

    :param expressions: output name to an expression of the inputs, e.g.
        ``{"out": "x + y"}``; checked against the whitelist before writing.
    :param options: the common keywords every packager takes
        (:class:`neuropod.create.PackageOptions`): ``platform_version_semver``
        (the numpy versions it works with), ``test_input_data`` and
        ``test_expected_out`` (stored, and the package is loaded and checked
        before this returns), ``package_as_zip``, ... The backend refuses
        packages with ``custom_ops``.
    :returns: the path written.
    """
    names = {s.name for s in parse_spec(input_spec, "input_spec")}
    for out, text in expressions.items():
        compile_expression(text, names, f"output {out!r} of model {model_name!r}")
    model = json.dumps({"outputs": dict(expressions)}, indent=2) + "\n"
    return create_package(
        "create_numpy_expr_neuropod", neuropod_path, model_name, PLATFORM, input_spec, output_spec,
        {f"0/data/{MODEL_FILE}": model.encode()}, options, framework_distributions=("numpy",),
        defaults={"default_input_tensor_device": "CPU"},  # numpy runs on the CPU only
    )  # fmt: skip


__all__ = ["create_numpy_expr_neuropod"]
