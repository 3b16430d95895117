"""Plain JSON request bodies read the quick way (orjson first, checks after) answer exactly what
the checked way (bounds scanned first) answers: the same arrays, or the same error, for every
odd or hostile body, and the quick way is taken for the common one."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from neuropod.spec import parse_spec
from neuropod_serving.protocol import ProtocolError, bodies, build_infer_request, inference, parse_infer_request

#: Enough numbers to make every body long (the quick way is for bodies of 4 KiB and more).
PAD = [round(0.001 * i, 3) for i in range(1500)]


def _spec(datatype: str = "float32") -> dict[str, Any]:
    specs = parse_spec(
        [{"name": "x", "dtype": datatype, "shape": [None]}, {"name": "pad", "dtype": "float32", "shape": [1500]}], "inputs"
    )
    return {s.name: s for s in specs}


def _body(x: str, datatype: str = "FP32", shape: str = "[2]", extra: str = "", top: str = "") -> bytes:
    """A request of input ``x`` (its data as JSON text) beside a long ``pad`` input."""
    pad = json.dumps(PAD)
    text = (
        f'{{{top}"inputs":[{{"name":"x","datatype":"{datatype}","shape":{shape},"data":{x}{extra}}},'
        f'{{"name":"pad","datatype":"FP32","shape":[1500],"data":{pad}}}]}}'
    )
    body = text.encode("utf-8", "surrogatepass")
    assert len(body) >= bodies.LONG_TEXT
    return body


def _outcome(body: bytes, spec: dict[str, Any], *, quick: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        if not quick:
            m.setattr(inference, "unchecked_request", lambda body, specs: None)
        try:
            r = parse_infer_request(body, None, input_spec=spec)
        except ProtocolError as e:
            return ("error", str(e), e.status)
    arrays = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in r.inputs.items()}
    return ("ok", arrays, r.id, r.parameters, r.outputs, repr(r.options))


HUGE = "1" + "0" * 39
DEEP = "[" * 70 + "1" + "]" * 70
CASES = [
    # (data, datatype, spec dtype, shape, extra keys in the tensor, top-level keys)
    ("[1.5, -2.25]", "FP32", "float32", "[2]", "", ""),
    ("[[1.5], [2]]", "FP32", "float32", "[2]", "", ""),
    ("[1, 2]", "INT64", "int64", "[2]", "", ""),
    ("[true, false]", "BOOL", "bool", "[2]", "", ""),
    ("[true, false]", "FP32", "float32", "[2]", "", ""),
    ("[1.5, true]", "FP32", "float32", "[2]", "", ""),
    ('[1, "2"]', "FP32", "float32", "[2]", "", ""),
    ("[1, null]", "FP32", "float32", "[2]", "", ""),
    ("[1, [2]]", "FP32", "float32", "[2]", "", ""),
    ("[1.5, 2]", "INT64", "int64", "[2]", "", ""),
    ("[1, 2, 3]", "FP32", "float32", "[2]", "", ""),
    ("[]", "FP32", "float32", "[0]", "", ""),
    ("[1e30, -1e30]", "FP32", "float32", "[2]", "", ""),
    (f"[{HUGE}, 1]", "FP32", "float32", "[2]", "", ""),
    (f"[{HUGE}, 1.5]", "FP64", "float64", "[2]", "", ""),
    ("[100000000000000000000, 1]", "FP32", "float32", "[2]", "", ""),
    ("[18446744073709551615, 1]", "FP64", "float64", "[2]", "", ""),
    ("[18446744073709551616, 1]", "FP64", "float64", "[2]", "", ""),
    ("[-9223372036854775809, 1]", "FP64", "float64", "[2]", "", ""),
    ("[9223372036854775808, 1]", "FP32", "float32", "[2]", "", ""),
    ("[9223372036854775808, 1]", "INT64", "int64", "[2]", "", ""),
    ("[18446744073709551615, 1]", "UINT64", "uint64", "[2]", "", ""),
    ("[18446744073709551616, 1]", "UINT64", "uint64", "[2]", "", ""),
    ("[300, 1]", "UINT8", "uint8", "[2]", "", ""),
    ("[-1, 1]", "UINT8", "uint8", "[2]", "", ""),
    ("[1e400, 1]", "FP64", "float64", "[2]", "", ""),
    ("[NaN, 1]", "FP32", "float32", "[2]", "", ""),
    ("[Infinity, 1]", "FP32", "float32", "[2]", "", ""),
    (DEEP, "FP32", "float32", "[1]", "", ""),
    # Read together with pad's numbers (one conversion for every input) only where that gives the same arrays.
    ("[16777217, 1]", "FP32", "float32", "[2]", "", ""),
    ("[9007199254740993, 1]", "FP32", "float32", "[2]", "", ""),
    ("[9007199254740993, 1.5]", "FP64", "float64", "[2]", "", ""),
    ("[true, 1.5]", "FP32", "float32", "[2]", "", ""),
    ("[[1.5]]", "FP32", "float32", "[1]", "", ""),
    ("[[1.5, 2]]", "FP32", "float32", "[1, 2]", "", ""),
    ('["1.5", "2"]', "FP32", "float32", "[2]", "", ""),
    ("[1, 2]", "FP32", "float32", "[2.0]", "", ""),
    ("[1, 2]", "FP32", "float32", "[18446744073709551616]", "", ""),
    ("[1, 2]", "FP32", "float32", "[" + ",".join(["1"] * 33) + "]", "", ""),
    ("[1, 2]", "FP16", "float32", "[2]", "", ""),
    ("[1, 2]", "FP32", "float32", "[2]", ',"parameters":{}', ""),
    ("[1, 2]", "FP32", "float32", "[2]", ',"parameters":null', ""),
    ("[1, 2]", "FP32", "float32", "[2]", ',"parameters":{"a":1}', ""),
    ("[1, 2]", "FP32", "float32", "[2]", ',"parameters":[]', ""),
    ("[1, 2]", "FP32", "float32", "[2]", f',"other":{DEEP}', ""),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"id":"r1","parameters":{"binary_data_output":false},'),
    ("[1, 2]", "FP32", "float32", "[2]", "", f'"parameters":{{"deep":{DEEP}}},'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"parameters":{"priority":123456789012345678901},'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"parameters":{"priority":1.5e20},'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"parameters":{"timeout":1000},"id":7,'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"outputs":[{"name":"y","parameters":{"binary_data":false}}],'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"outputs":[{"name":"y","parameters":{"classification":99999999999999999999}}],'),
    ("[1, 2]", "FP32", "float32", "[2]", "", f'"unknown":{DEEP},'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"unknown":"\\ud800",'),
    ("[1, 2]", "FP32", "float32", "[2]", "", '"inputs":[],'),
]


@pytest.mark.parametrize(("data", "datatype", "dtype", "shape", "extra", "top"), CASES)
def test_quick_way_answers_as_the_checked_way(
    data: str, datatype: str, dtype: str, shape: str, extra: str, top: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    body, spec = _body(data, datatype, shape, extra, top), _spec(dtype)
    checked = _outcome(body, spec, quick=False, monkeypatch=monkeypatch)
    assert _outcome(body, spec, quick=True, monkeypatch=monkeypatch) == checked
    assert _outcome(body, None, quick=True, monkeypatch=monkeypatch) == _outcome(
        body, None, quick=False, monkeypatch=monkeypatch
    )


def test_odd_bytes_answer_as_the_checked_way(monkeypatch: pytest.MonkeyPatch) -> None:
    good = _body("[1, 2]")
    spec = _spec()
    for body in (good[:-1], good + b"x", good.replace(b'"x"', b'"\xff"'), good.replace(b'"x"', b'"\\ud800"'),
                 good.replace(b'"pad"', b'"x"'), b"[" + good + b"]", good.replace(b"1500]", b"1500.0]")):  # fmt: skip
        assert _outcome(body, spec, quick=True, monkeypatch=monkeypatch) == _outcome(
            body, spec, quick=False, monkeypatch=monkeypatch
        )


def test_a_true_among_many_float_tensors_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """One true in one of 100 tensors read the quick way (one conversion for all of them, then one per
    tensor) is found and refused, as the checked way refuses it; 1.0 and 0 sent as numbers are not."""
    rng = np.random.default_rng(0)
    tensors = [{"name": f"x{i}", "datatype": "FP32", "shape": [10, 5], "data": rng.standard_normal(50).tolist()}
               for i in range(100)]  # fmt: skip
    tensors[40]["data"][7] = True
    tensors[70]["data"][:2] = [1.0, 0]
    body = json.dumps({"inputs": tensors}).encode()
    quick = _outcome(body, None, quick=True, monkeypatch=monkeypatch)
    assert quick == _outcome(body, None, quick=False, monkeypatch=monkeypatch)
    assert quick[0] == "error" and "tensor 'x40': FP32 data must be JSON numbers; got true or false" in quick[1]
    tensors[40]["data"][7] = 1.0
    ok = parse_infer_request(json.dumps({"inputs": tensors}).encode()).inputs
    assert ok["x40"][1, 2] == 1.0 and ok["x70"].ravel()[:2].tolist() == [1.0, 0.0]


def test_the_common_body_takes_the_quick_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the neuropod client sends for 100 float32 inputs is read without the text scans, and
    reads as the arrays sent."""
    rng = np.random.default_rng(0)
    inputs = {f"x{i}": rng.standard_normal((10, 5)).astype(np.float32) for i in range(100)}
    body = build_infer_request(inputs, binary=False, binary_outputs=False).content
    taken = []
    original = inference.unchecked_request
    monkeypatch.setattr(inference, "unchecked_request", lambda b, s: taken.append(original(b, s)) or taken[-1])
    monkeypatch.setattr(bodies._json, "check_bounds", lambda *a, **k: pytest.fail("the text was scanned"))
    decoded = parse_infer_request(body, None).inputs
    assert taken and taken[0] is not None
    assert decoded.keys() == inputs.keys()
    for name, array in inputs.items():
        assert decoded[name].dtype == np.float32 and np.array_equal(decoded[name], array)
        assert decoded[name].flags.writeable and decoded[name].flags.c_contiguous
    # All made by one conversion: views of one buffer.
    assert decoded["x0"].base is not None and decoded["x0"].base is decoded["x99"].base
