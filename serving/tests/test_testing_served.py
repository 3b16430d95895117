"""neuropod.testing.served / oip_infer, the helpers other backends' suites use to check that
`neuropod serve` serves their packages, tried here on an ONNX package."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")

from neuropod.testing import oip_infer, served

from conftest import adder_and_echo


def test_served_answers_plain_json_and_stops(tmp_path: Path) -> None:
    adder_and_echo(tmp_path / "models", echo_as_zip=True)
    x = np.array([[1.5, 2], [3, 4]], np.float32)
    y = np.array([[10, 20], [30, 40]], np.float32)
    with served(tmp_path / "models") as server:
        out = oip_infer(server.http, "adder", {"x": x, "y": y})
    assert out["out"].dtype == np.float32
    np.testing.assert_array_equal(out["out"], x + y)
    np.testing.assert_array_equal(out["doubled"], (x + y) * 2)
    with pytest.raises(OSError):  # the server is gone once the block ends
        urllib.request.urlopen(f"{server.http}/v2/health/ready", timeout=2)
