"""Tensor names with '/', ':' and '.' on JAX packages: inputs are positional (in spec order) and
outputs dict keys, so any name the spec allows works."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import neuropod
from neuropod.packagers import create_jax_neuropod

IN = "input/x:0"
OUT = "InceptionV3/Predictions/Softmax:0"


def test_names_with_slashes_colons_and_dots(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp

    def fn(x: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
        return {OUT: jax.nn.softmax(x, axis=-1), "out.1": y + 1}

    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    y = np.arange(2, dtype=np.float32)
    path = create_jax_neuropod(
        tmp_path / "named", "named",
        [{"name": IN, "dtype": "float32", "shape": ["batch", 4]}, {"name": "in.1", "dtype": "float32", "shape": ["batch"]}],
        [{"name": OUT, "dtype": "float32", "shape": ["batch", 4]}, {"name": "out.1", "dtype": "float32", "shape": ["batch"]}],
        fn=fn, test_input_data={IN: x, "in.1": y},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({IN: x, "in.1": y})
    np.testing.assert_allclose(out[OUT], np.asarray(jax.nn.softmax(jnp.asarray(x), axis=-1)), rtol=1e-6)
    np.testing.assert_array_equal(out["out.1"], y + 1)
