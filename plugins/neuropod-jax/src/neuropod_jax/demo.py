"""The model behind ``neuropod demo jax``: a two-layer MLP whose weights are a pytree stored beside the program."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuropod.plugins import import_framework

INPUT_SPEC: list[dict[str, Any]] = [{"name": "x", "dtype": "float32", "shape": ["batch_size", 4]}]
OUTPUT_SPEC: list[dict[str, Any]] = [
    {"name": "scores", "dtype": "float32", "shape": ["batch_size", 3]},
    {"name": "label", "dtype": "int32", "shape": ["batch_size"]},
]


def build_demo(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Package the demo model in ``directory``.

    :returns: the package path, inputs that fit, and inputs of the wrong
        width (for showing a spec error).
    """
    import numpy as np

    import_framework("jax", "jax", "neuropod demo jax")
    import jax
    import jax.numpy as jnp

    # lazy: numpy (the packager imports it), kept out of importing this module (as numpy above)
    from neuropod_jax.packager import create_jax_neuropod

    def mlp(params: dict[str, Any], x: Any) -> dict[str, Any]:
        h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
        scores = jax.nn.softmax(h @ params["out"]["w"] + params["out"]["b"])
        return {"scores": scores, "label": jnp.argmax(scores, axis=-1).astype(jnp.int32)}

    rng = np.random.default_rng(0)
    params = {
        "hidden": {"w": rng.standard_normal((4, 8)).astype(np.float32), "b": np.zeros(8, np.float32)},
        "out": {"w": rng.standard_normal((8, 3)).astype(np.float32), "b": np.zeros(3, np.float32)},
    }
    x = rng.standard_normal((2, 4)).astype(np.float32)
    expected = {k: np.asarray(v) for k, v in jax.jit(mlp)(params, x).items()}
    path = create_jax_neuropod(
        Path(directory) / "demo_mlp.neuropod",
        "demo_mlp",
        INPUT_SPEC,
        OUTPUT_SPEC,
        fn=mlp,
        params=params,
        test_input_data={"x": x},
        test_expected_out=expected,
    )
    return path, {"x": x}, {"x": np.ones((2, 5), dtype=np.float32)}
