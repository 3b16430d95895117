"""Class labels per output (``output_labels``): the packager option, ``config.json``, and their checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from neuropod.create import package_options, packager_config
from neuropod.errors import PackageError
from neuropod.package import parse_config

OUTPUTS = [{"name": "probs", "dtype": "float32", "shape": ["batch", 3]},
           {"name": "text", "dtype": "string", "shape": ["batch"]}]  # fmt: skip
INPUTS = [{"name": "x", "dtype": "float32", "shape": ["batch", 3]}]


def test_labels_round_trip_through_config_json(tmp_path: Path) -> None:
    config = packager_config("m", "toy", INPUTS, OUTPUTS, output_labels={"probs": ["cat", "dog", "a:b c"]})
    assert config.output_labels == {"probs": ("cat", "dog", "a:b c")}
    written = config.to_dict()
    assert written["output_labels"] == {"probs": ["cat", "dog", "a:b c"]}
    back = parse_config(json.loads(json.dumps(written)), "config.json")
    assert back.output_labels == config.output_labels and "output_labels" not in back.extra
    # Without labels nothing is written, and an original package reads as having none.
    plain = packager_config("m", "toy", INPUTS, OUTPUTS)
    assert plain.output_labels == {} and "output_labels" not in plain.to_dict()


def test_labels_are_a_common_packager_option() -> None:
    assert package_options("create_toy_neuropod", {"output_labels": {"probs": ["a"]}})["output_labels"] == {
        "probs": ["a"]
    }
    assert package_options("create_toy_neuropod", {})["output_labels"] is None


@pytest.mark.parametrize(
    ("labels", "needle"),
    [
        (["a"], "must map output names to lists of class labels, not list"),
        ({"nope": ["a"]}, "'nope' is not an output of the model; its outputs are: probs, text"),
        ({"text": ["a"]}, "output 'text' is a string tensor"),
        ({"probs": "abc"}, "the labels of output 'probs' must be a non-empty list of strings"),
        ({"probs": []}, "the labels of output 'probs' must be a non-empty list of strings"),
        ({"probs": ["a", 3]}, "label 1 of output 'probs' must be a string without line breaks, not 3"),
        ({"probs": ["a\nb"]}, "label 0 of output 'probs' must be a string without line breaks"),
    ],
)
def test_bad_labels_are_refused_naming_what_is_wrong(labels: Any, needle: str) -> None:
    with pytest.raises(PackageError, match="output_labels") as info:
        packager_config("m", "toy", INPUTS, OUTPUTS, output_labels=labels)
    assert needle in str(info.value)
    data = {"name": "m", "platform": "toy", "input_spec": INPUTS, "output_spec": OUTPUTS, "output_labels": labels}
    with pytest.raises(PackageError, match=r"config.json: output_labels") as info:
        parse_config(data, "config.json")
    assert needle in str(info.value)
