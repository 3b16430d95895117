"""Decoupled python models: the function is a generator of output dicts, run with infer_stream,
in this process and in a worker process."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.errors import BackendError, NeuropodError
from neuropod.packagers import create_python_neuropod

from conftest import write_code

SPEC_IN = [{"name": "IN", "dtype": "int32", "shape": ["n"]}, {"name": "DELAY", "dtype": "uint32", "shape": ["n"]}]
SPEC_OUT = [
    {"name": "OUT", "dtype": "int32", "shape": [1]},
    {"name": "IDX", "dtype": "uint32", "shape": [1]},
    {"name": "TEXT", "dtype": "string", "shape": [1]},
]

CODE = """
import os, time
import numpy as np

def get_model(data_root):
    def run(IN, DELAY, parameters=None):
        log = (parameters or {}).get("log")
        word = (parameters or {}).get("word", "w")
        try:
            for i, v in enumerate(IN.tolist()):
                time.sleep(int(DELAY[i]) / 1e6)
                if v < 0:
                    raise ValueError(f"negative input {v}")
                yield {"OUT": np.array([v], np.int32), "IDX": np.array([i], np.uint32),
                       "TEXT": np.array([f"{word}{i}"], dtype=object)}
        finally:
            if log:
                with open(log, "a") as f:
                    f.write("finally\\n")
    return run
"""


def _package(tmp_path: Path, code: str = CODE, **kwargs: Any) -> Path:
    src = write_code(tmp_path / "src", {"rep.py": code})
    return create_python_neuropod(tmp_path / "pkg", "repeat_int32", [], [{"python_root": src, "dirs_to_package": [""]}],
                                  "rep", "get_model", SPEC_IN, SPEC_OUT, decoupled=True, **kwargs)  # fmt: skip


def _inputs(values: list[int], delay_us: int = 0) -> dict[str, np.ndarray]:
    return {"IN": np.array(values, np.int32), "DELAY": np.full(len(values), delay_us, np.uint32)}


def _plain(responses: Any) -> list[dict[str, Any]]:
    return [{k: v.tolist() for k, v in r.items()} for r in responses]


def _expected(values: list[int], word: str = "w") -> list[dict[str, Any]]:
    return [{"OUT": [v], "IDX": [i], "TEXT": [f"{word}{i}"]} for i, v in enumerate(values)]


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "worker"])
def test_a_generator_streams_its_responses(tmp_path: Path, use_ope: bool) -> None:
    values = [4, 8, 15, 16]
    # The package's test data are the responses joined: checked when it is made.
    path = _package(tmp_path, test_input_data=_inputs(values),
                    test_expected_out={"OUT": np.array(values, np.int32), "IDX": np.arange(4, dtype=np.uint32),
                                       "TEXT": np.array([f"w{i}" for i in range(4)], dtype=object)})  # fmt: skip
    assert json.loads((path / "config.json").read_text())["decoupled"] is True
    log = tmp_path / "finally.log"
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        assert model.decoupled
        began = time.monotonic()
        stream = model.infer_stream(_inputs(values, delay_us=100_000))
        first = next(stream)
        assert time.monotonic() - began < 0.3, "the first response comes before the later ones are made"
        assert _plain([first, *stream]) == _expected(values)
        # Parameters reach the generator; a subset of the outputs.
        got = model.infer_stream(_inputs([1, 2]), ["TEXT"], parameters={"word": "tok", "log": str(log)})
        assert _plain(got) == [{"TEXT": ["tok0"]}, {"TEXT": ["tok1"]}]
        assert log.read_text() == "finally\n"
        # Closed early: the generator's finally runs.
        with model.infer_stream(_inputs([1, 2, 3]), parameters={"log": str(log)}) as stream:
            next(stream)
        assert log.read_text() == "finally\n" * 2
        # An exception after two responses: they arrive, then the error naming the model.
        stream = model.infer_stream(_inputs([1, 2, -1, 3]), parameters={"log": str(log)})
        assert _plain([next(stream), next(stream)]) == _expected([1, 2])
        with pytest.raises(BackendError, match=r"(?s)Model 'repeat_int32' raised ValueError: negative input -1"):
            next(stream)
        assert log.read_text() == "finally\n" * 3
        assert _plain(model.infer_stream(_inputs([7]))) == _expected([7]), "the model carries on"
        with pytest.raises(NeuropodError, match="decoupled.*infer_stream"):
            model.infer(_inputs([1]))


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "worker"])
def test_a_decoupled_function_must_be_a_generator(tmp_path: Path, use_ope: bool) -> None:
    code = "import numpy as np\ndef get_model(data_root):\n    return lambda IN, DELAY: {'OUT': IN[:1]}\n"
    with neuropod.load_neuropod(_package(tmp_path, code), use_ope=use_ope) as model:
        stream = model.infer_stream(_inputs([1]))
        with pytest.raises(BackendError, match=r"Model 'repeat_int32' is decoupled.*generator.*returned dict"):
            next(stream)


def test_test_data_that_differ_from_the_joined_responses_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NeuropodError, match="'OUT'"):
        _package(tmp_path, test_input_data=_inputs([1, 2]),
                 test_expected_out={"OUT": np.array([1, 3], np.int32)})  # fmt: skip


def test_a_decoupled_model_streams_from_its_lock_environment(tmp_path: Path, neuropod_home: Path) -> None:
    path = _package(tmp_path)
    lock = "six==1.16.0\n"  # the lock of the requirements tests: one environment for both
    (path / "0" / "requirements.lock").write_text(lock)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["0/requirements.lock"] = hashlib.sha256(lock.encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    log = tmp_path / "finally.log"
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location.startswith("env:lock-")
        assert _plain(model.infer_stream(_inputs([3, 1]), parameters={"word": "t"})) == _expected([3, 1], "t")
        with model.infer_stream(_inputs([1, 2, 3]), parameters={"log": str(log)}) as stream:
            assert _plain([next(stream)]) == _expected([1])
        assert log.read_text() == "finally\n"
