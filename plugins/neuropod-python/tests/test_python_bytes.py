"""bytes tensors through the Python backend: binary data reaches the model function and comes back exactly."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod.errors import SpecError
from neuropod.packagers import create_python_neuropod
from neuropod.spec import to_bytes_array
from neuropod.testdata import run_test_data

from conftest import write_code

# A model that reads JPEG-like files: their lengths, whether each starts with a JPEG's SOI marker, their
# SHA-256 (as bytes) and each file reversed. Every output is computed from the bytes as they arrived.
IMAGES_SOURCE = """
import hashlib

import numpy as np

def images(data):
    flat = data.ravel().tolist()
    if not all(type(b) is bytes for b in flat):
        raise TypeError("expected bytes, got " + ", ".join(sorted({type(b).__name__ for b in flat})))
    digests = np.empty(len(flat), dtype=object)
    digests[:] = [hashlib.sha256(b).digest() for b in flat]
    reversed_ = np.empty(len(flat), dtype=object)
    reversed_[:] = [b[::-1] for b in flat]
    return {
        "length": np.array([len(b) for b in flat], np.int64).reshape(data.shape),
        "is_jpeg": np.array([b[:3] == b"\\xff\\xd8\\xff" for b in flat]).reshape(data.shape),
        "digest": digests.reshape(data.shape),
        "reversed": reversed_.reshape(data.shape),
    }

def get_model(_):
    return images
"""
IN_SPEC = [{"name": "data", "dtype": "bytes", "shape": ["batch"]}]
OUT_SPEC = [
    {"name": "length", "dtype": "int64", "shape": ["batch"]},
    {"name": "is_jpeg", "dtype": "bool", "shape": ["batch"]},
    {"name": "digest", "dtype": "bytes", "shape": ["batch"]},
    {"name": "reversed", "dtype": "bytes", "shape": ["batch"]},
]
# Not UTF-8, NULs inside and at the end, and an empty element.
FILES = [b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\xff\xd9", b"\x00\x00", b"", b"GIF89a\x00\xff\x00"]


def expected(files: list[bytes]) -> dict[str, list[object]]:
    return {
        "length": [len(f) for f in files],
        "is_jpeg": [f.startswith(b"\xff\xd8\xff") for f in files],
        "digest": [hashlib.sha256(f).digest() for f in files],
        "reversed": [bytes(reversed(f)) for f in files],
    }


@pytest.fixture(scope="module")
def images_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("bytes")
    code = write_code(tmp / "code", {"images.py": IMAGES_SOURCE})
    want = expected(FILES)
    path: Path = create_python_neuropod(
        tmp / "images.neuropod", "images", [], [{"python_root": code, "dirs_to_package": [""]}],
        "images", "get_model", IN_SPEC, OUT_SPEC,
        test_input_data={"data": to_bytes_array(FILES)},
        test_expected_out={k: (to_bytes_array(v) if k in ("digest", "reversed") else np.array(v)) for k, v in want.items()},
    )  # fmt: skip
    return path


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "worker"])
def test_bytes_reach_the_model_and_come_back_exactly(images_package: Path, use_ope: bool) -> None:
    want = expected(FILES)
    with neuropod.load_neuropod(images_package, use_ope=use_ope) as model:
        out = model.infer({"data": to_bytes_array(FILES)})
        if use_ope:  # a worker's inputs in shared memory are arrays of one dtype, which bytes are not
            with pytest.raises(ValueError, match="input 'data' is a bytes tensor, which shared memory cannot hold"):
                model.empty("data", 4)
    assert out["length"].tolist() == want["length"]
    assert out["is_jpeg"].tolist() == want["is_jpeg"]
    for name in ("digest", "reversed"):
        assert out[name].dtype == object
        assert out[name].tolist() == want[name]
        assert all(type(b) is bytes for b in out[name].tolist())


def test_bundled_bytes_test_data_round_trips(images_package: Path) -> None:
    report = run_test_data(images_package)
    assert report.passed, report.mismatches
    assert report.inputs["data"].tolist() == FILES  # trailing NULs and all
    assert report.outputs["reversed"].tolist() == expected(FILES)["reversed"]


def test_text_in_a_bytes_input_is_refused(images_package: Path) -> None:
    with neuropod.load_neuropod(images_package) as model, pytest.raises(SpecError, match=r"'data'.*hold bytes.*str"):
        model.infer({"data": np.array(["not bytes"], dtype=object)})
