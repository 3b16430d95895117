"""The JAX backend against the core's conformance suite (``neuropod.testing``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod.packagers import create_jax_neuropod
from neuropod.testing import NUMERIC_DTYPES, BackendConformance, accumulator_spec

from models import copy_fn


class TestJaxConformance(BackendConformance):
    platform = "jax"
    distribution = "neuropod-jax"
    framework_modules = ("jax", "jaxlib")
    dtypes = NUMERIC_DTYPES  # JAX has no strings; 64-bit dtypes run in JAX's 64-bit mode
    custom_ops = False

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """An exported function that returns ``{"out_<s>": in_<s>}``, positional in spec order."""
        fn = copy_fn([s["name"] for s in input_spec])
        path: Path = create_jax_neuropod(tmp_path / name, name, input_spec, output_spec, fn=fn, **packager_kwargs)
        return path

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """An exported ``(x, acc_in) -> {"y": acc_in + x, "acc_out": acc_in + x}``."""

        def accumulate(x: Any, acc_in: Any) -> dict[str, Any]:
            return {"y": acc_in + x, "acc_out": acc_in + x}

        input_spec, output_spec = accumulator_spec()
        path: Path = create_jax_neuropod(tmp_path / name, name, input_spec, output_spec, fn=accumulate, **packager_kwargs)
        return path
