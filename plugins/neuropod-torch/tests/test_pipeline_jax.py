"""A pipeline across frameworks: a torch.export step whose float32 output feeds a JAX step, checked
against each step's model run by hand and against numpy computed apart from either framework.

It needs jax beside torch (``nox -s tests_torch`` installs both); without jax it skips.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import neuropod
from neuropod.packagers import create_pipeline_neuropod, create_torch_export_neuropod

from conftest import spec

jax = pytest.importorskip("jax", reason="the JAX step needs jax (nox -s tests_torch installs it)")
create_jax_neuropod = pytest.importorskip("neuropod_jax.packager").create_jax_neuropod

X_SPEC = spec(("x", "float32", ["batch", 3]))
HIDDEN = spec(("h", "float32", ["batch", 5]))
HEAD_OUT = spec(("y", "float32", ["n", 2]), ("norm", "float32", ["n"]))


class Encoder(torch.nn.Module):
    """The torch.export step: h = relu(x @ W1.T + b1), float32 [batch, 5]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.relu(self.fc(x))}


def head_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((5, 2)).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)}


def head(params: dict[str, Any], h: Any) -> dict[str, Any]:
    """The JAX step: y = tanh(h @ W2 + b2), norm = |y| per row."""
    y = jax.numpy.tanh(h @ params["w"] + params["b"])
    return {"y": y, "norm": jax.numpy.sqrt(jax.numpy.sum(y * y, axis=-1))}


def numpy_reference(encoder: Encoder, params: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    """Both steps in float64 numpy, from the same weights."""
    w1 = encoder.fc.weight.detach().numpy().astype(np.float64)
    b1 = encoder.fc.bias.detach().numpy().astype(np.float64)
    h = np.maximum(x.astype(np.float64) @ w1.T + b1, 0.0)
    y = np.tanh(h @ params["w"].astype(np.float64) + params["b"].astype(np.float64))
    return {"hidden": h, "y": y, "norm": np.sqrt((y * y).sum(-1))}


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("torch-jax")
    encoder, params = Encoder().eval(), head_params()
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    enc = create_torch_export_neuropod(
        root / "encoder", "encoder", X_SPEC, HIDDEN, module=encoder, test_input_data={"x": x}
    )
    hd = create_jax_neuropod(root / "head", "head", spec(("h", "float32", ["n", 5])), HEAD_OUT, fn=head, params=params)
    ref = numpy_reference(encoder, params, x)
    pipe = create_pipeline_neuropod(
        root / "pipe",
        "encode_and_score",
        steps=[
            {"package": enc, "name": "encode", "input_map": {"x": "x"}, "output_map": {"h": "hidden"}},
            {"package": hd, "name": "score", "input_map": {"h": "hidden"}, "output_map": {"y": "y", "norm": "norm"}},
        ],
        input_spec=X_SPEC,
        output_spec=spec(
            ("hidden", "float32", ["batch", 5]), ("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"])
        ),
        test_input_data={"x": x},  # runs through both steps at packaging
        test_expected_out={"y": ref["y"].astype(np.float32), "norm": ref["norm"].astype(np.float32)},
    )
    return {"encoder": encoder, "params": params, "enc": enc, "head": hd, "pipe": pipe}


def batches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((n, 3)).astype(np.float32) for n in (1, 6, 40)]


def test_the_plan_runs_both_steps_in_this_process(packages: dict[str, Any]) -> None:
    plan = neuropod.plan(packages["pipe"])
    chosen = {s.step.name: s.resolution.chosen if s.resolution else None for s in plan.steps}
    assert chosen["encode"] is not None and chosen["score"] is not None
    assert (chosen["encode"].backend.platform, chosen["encode"].backend.location) == ("torch_export", "in-process")
    assert (chosen["score"].backend.platform, chosen["score"].backend.location) == ("jax", "in-process")
    assert "2 steps (encode -> score)" in plan.explain()


def test_torch_feeds_jax_as_each_model_by_hand_and_as_numpy(packages: dict[str, Any]) -> None:
    xs = batches()
    # Each step's package alone, chained by hand: the same backends, so the very same values.
    with neuropod.load_neuropod(packages["enc"]) as enc, neuropod.load_neuropod(packages["head"]) as hd:
        by_hand = []
        for x in xs:
            h = enc.infer({"x": x})["h"]
            by_hand.append({"hidden": h, **hd.infer({"h": h})})
    # Each framework's own model, outside neuropod: the eager module, then the jitted function.
    with torch.no_grad():
        eager_h = [packages["encoder"](torch.from_numpy(x))["h"].numpy() for x in xs]
    jitted = jax.jit(head)
    direct = [{k: np.asarray(v) for k, v in jitted(packages["params"], h).items()} for h in eager_h]

    with neuropod.load_neuropod(packages["pipe"]) as pipe:
        assert pipe.steps["encode"].backend.platform == "torch_export"
        assert pipe.steps["score"].backend.platform == "jax"
        outs = [pipe.infer({"x": x}) for x in xs]
        assert {s: v["count"] for s, v in pipe.step_statistics().items()} == {"encode": 3, "score": 3}

    for x, out, hand, fw in zip(xs, outs, by_hand, direct, strict=True):
        assert {k: (v.dtype, v.shape) for k, v in out.items()} == {
            "hidden": (np.float32, (len(x), 5)),
            "y": (np.float32, (len(x), 2)),
            "norm": (np.float32, (len(x),)),
        }
        for name in ("hidden", "y", "norm"):
            np.testing.assert_array_equal(out[name], hand[name], err_msg=name)
        np.testing.assert_allclose(out["y"], fw["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out["norm"], fw["norm"], rtol=1e-6, atol=1e-6)
        ref = numpy_reference(packages["encoder"], packages["params"], x)
        for name, got in (("hidden", out["hidden"]), ("y", out["y"]), ("norm", out["norm"])):
            np.testing.assert_allclose(got, ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_torch_step_in_a_worker_process_feeds_jax_the_same(packages: dict[str, Any]) -> None:
    """The torch step moved to a worker process (its output comes back through shared memory): same values."""
    x = batches()[1]
    with neuropod.load_neuropod(packages["pipe"]) as here:
        expected = here.infer({"x": x})
    with neuropod.load_neuropod(packages["pipe"], step_options={"encode": {"use_ope": True}}) as pipe:
        assert pipe.steps["encode"].worker_pids and os.getpid() not in pipe.steps["encode"].worker_pids
        assert pipe.steps["score"].backend.location == "in-process"
        got = pipe.infer({"x": x})
    for name in ("hidden", "y", "norm"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_wrong_dtype_between_torch_and_jax_is_refused_at_packaging(packages: dict[str, Any], tmp_path: Path) -> None:
    """A float64 JAX input fed by the float32 torch output: refused, naming the step and the tensor."""
    wide = create_jax_neuropod(
        tmp_path / "wide",
        "wide",
        spec(("h", "float64", ["n", 5])),
        spec(("y", "float64", ["n", 2]), ("norm", "float64", ["n"])),
        fn=head,
        params=packages["params"],
    )
    with pytest.raises(neuropod.PackageError) as info:
        create_pipeline_neuropod(
            tmp_path / "bad",
            "bad",
            steps=[
                {"package": packages["enc"], "name": "encode", "input_map": {"x": "x"}, "output_map": {"h": "hidden"}},
                {"package": wide, "name": "score", "input_map": {"h": "hidden"}, "output_map": {"y": "y"}},
            ],
            input_spec=X_SPEC,
            output_spec=spec(("y", "float64", ["batch", 2])),
        )
    message = str(info.value)
    assert "'hidden'" in message and "score" in message and "float64" in message and "float32" in message, message
    assert not (tmp_path / "bad").exists()
