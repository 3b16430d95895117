"""ONNX packages with the interfaces of Triton's sequence models, for Triton's sequence client examples
(``simple_*_sequence_*_infer_client.py``) and other sequence tests.

What each computes is Triton's own, read from its sources (triton-inference-server/server):

- ``simple_sequence`` (``docs/examples/model_repository/simple_sequence``, an ONNX graph):
  INT32 ``INPUT``, ``START``, ``READY`` [batch, 1] -> ``OUTPUT`` = READY * (INPUT + START).
  It carries no state: the controls are its only sequence inputs, and any sequence id works
  (numeric, or a string such as the UUID the examples send it).
- ``simple_dyna_sequence`` (same folder): adds INT32 ``END`` and UINT64 ``CORRID``:
  ``OUTPUT`` = READY * (INPUT + START + END * int32(CORRID)); numeric ids only.
- ``simple_string_dyna_sequence``: Triton's test ``dyna_sequence`` backend
  (``src/test/dyna_sequence``, which its QA serves under that name with a STRING ``CORRID``) as
  an ONNX graph with implicit state: an INT32 accumulator per sequence, set to the sum of
  ``INPUT`` on START, else increased by it; on END the id (a decimal string, parsed) is added;
  ``OUTPUT`` = the accumulator. The state is ``ACC_IN`` -> ``ACC_OUT`` (INT32 [batch, 1], starting
  at zero). ``string_ids=False`` builds the same with a UINT64 ``CORRID`` (Triton's
  ``custom_dyna_sequence_int32``).

Each package is declared one of two ways (``via``):

- ``"keywords"``: packaged with ``sequence_controls`` (and ``state_spec``), stateful as packaged;
- ``"plain"``: the same graph packaged without them (every control and state tensor an ordinary
  input or output); :func:`triton_config` is then Triton's model configuration (JSON form, with
  ``sequence_batching { control_input [...], state [...] }``) that makes it stateful when sent
  with a repository load: ``POST /v2/repository/models/{m}/load`` with
  ``{"parameters": {"config": json.dumps(triton_config(m))}}``.

:func:`expected_outputs` computes what a sequence's steps answer, in plain Python (independently
of the graphs), for tests that check values themselves.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from onnx import TensorProto, helper

from conftest import onnx_package

Via = Literal["keywords", "plain"]

SIMPLE = "simple_sequence"
DYNA = "simple_dyna_sequence"
STRING_DYNA = "simple_string_dyna_sequence"
#: Every model :func:`sequence_repository` builds.
NAMES = (SIMPLE, DYNA, STRING_DYNA)

ROW = ["batch_size", 1]
_INT32 = TensorProto.INT32


def _controls(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "kind": f"CONTROL_SEQUENCE_{kind}"} for name, kind in pairs]


def simple_sequence_package(root: Path, *, via: Via = "keywords", name: str = SIMPLE) -> Path:
    """Triton's ``simple_sequence`` at ``root / name``: OUTPUT = READY * (INPUT + START), no state."""
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
    ]
    inputs = [("INPUT", "int32", ROW), ("START", "int32", ROW), ("READY", "int32", ROW)]
    keywords: dict[str, Any] = {}
    if via == "keywords":
        keywords["sequence_controls"] = _controls(("START", "START"), ("READY", "READY"))
    return onnx_package(root / name, name, nodes, inputs, [("OUTPUT", "int32", ROW)], **keywords)


def simple_dyna_sequence_package(
    root: Path, *, via: Via = "keywords", string_ids: bool = False, name: str | None = None
) -> Path:
    """Triton's ``simple_dyna_sequence`` (``string_ids=False``, stateless, UINT64 CORRID) or its
    ``simple_string_dyna_sequence`` (``string_ids=True``: the accumulator with implicit state and a
    STRING CORRID) at ``root / name``. For the accumulator with a UINT64 CORRID, see
    :func:`dyna_accumulator_package`."""
    if string_ids:
        return dyna_accumulator_package(root, via=via, string_ids=True, name=name or STRING_DYNA)
    name = name or DYNA
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=_INT32),
        helper.make_node("Add", ["INPUT", "START"], ["add0"]),
        helper.make_node("Mul", ["END", "corrid"], ["mul0"]),
        helper.make_node("Add", ["add0", "mul0"], ["sum0"]),
        helper.make_node("Mul", ["READY", "sum0"], ["OUTPUT"]),
    ]
    inputs = [("INPUT", "int32", ROW), ("START", "int32", ROW), ("END", "int32", ROW), ("READY", "int32", ROW),
              ("CORRID", "uint64", ROW)]  # fmt: skip
    keywords: dict[str, Any] = {}
    if via == "keywords":
        keywords["sequence_controls"] = _controls(("START", "START"), ("END", "END"), ("READY", "READY"),
                                                  ("CORRID", "CORRID"))  # fmt: skip
    return onnx_package(root / name, name, nodes, inputs, [("OUTPUT", "int32", ROW)], **keywords)


def dyna_accumulator_package(
    root: Path, *, via: Via = "keywords", string_ids: bool = True, name: str = STRING_DYNA
) -> Path:
    """Triton's ``dyna_sequence`` test backend as an ONNX graph with implicit state (``ACC_IN`` ->
    ``ACC_OUT``): acc = (START ? 0 : acc) + sum(INPUT) + END * int32(CORRID), when READY (else
    unchanged); OUTPUT = acc. CORRID is STRING (decimal ids) or UINT64 (``string_ids=False``)."""
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["not_start"]),
        helper.make_node("Mul", ["ACC_IN", "not_start"], ["kept"]),
        helper.make_node("ReduceSum", ["INPUT", "axis1"], ["total"], keepdims=1),
        helper.make_node("Add", ["kept", "total"], ["acc0"]),
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=_INT32),
        helper.make_node("Mul", ["END", "corrid"], ["at_end"]),
        helper.make_node("Add", ["acc0", "at_end"], ["acc1"]),
        # READY=0 leaves the accumulator as it was.
        helper.make_node("Sub", ["acc1", "ACC_IN"], ["change"]),
        helper.make_node("Mul", ["READY", "change"], ["ready_change"]),
        helper.make_node("Add", ["ACC_IN", "ready_change"], ["ACC_OUT"]),
        helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
    ]
    inits = [helper.make_tensor("one", _INT32, [], [1]), helper.make_tensor("axis1", TensorProto.INT64, [1], [1])]
    corrid = "string" if string_ids else "uint64"
    inputs = [("INPUT", "int32", ["batch_size", None]), ("START", "int32", ROW), ("END", "int32", ROW),
              ("READY", "int32", ROW), ("CORRID", corrid, ROW), ("ACC_IN", "int32", ROW)]  # fmt: skip
    outputs = [("OUTPUT", "int32", ROW), ("ACC_OUT", "int32", ROW)]
    keywords: dict[str, Any] = {}
    if via == "keywords":
        keywords["sequence_controls"] = _controls(("START", "START"), ("END", "END"), ("READY", "READY"),
                                                  ("CORRID", "CORRID"))  # fmt: skip
        keywords["state_spec"] = [{"input_name": "ACC_IN", "output_name": "ACC_OUT", "initial_state": "zero"}]
    with warnings.catch_warnings():
        # Packaging checks the state outputs with one step of a new sequence; its id is not a decimal
        # string, which this model (as Triton's backend) refuses, so the check is skipped with a warning.
        warnings.filterwarnings("ignore", "The state outputs of model", UserWarning)
        return onnx_package(root / name, name, nodes, inputs, outputs, inits, **keywords)


def sequence_repository(root: Path, *, via: Via = "keywords") -> list[str]:
    """Triton's three sequence models in ``root`` (a model repository), declared ``via``; their names."""
    simple_sequence_package(root, via=via)
    simple_dyna_sequence_package(root, via=via)
    simple_dyna_sequence_package(root, via=via, string_ids=True)
    return list(NAMES)


# -- Triton's model configurations ----------------------------------------------------------------


def _control(name: str, kind: str, data_type: str | None = None) -> dict[str, Any]:
    control: dict[str, Any] = {"kind": f"CONTROL_SEQUENCE_{kind}"}
    if data_type is None:
        control["int32_false_true"] = [0, 1]
    else:
        control["data_type"] = data_type
    return {"name": name, "control": [control]}


_TENSORS = {
    "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "OUTPUT", "data_type": "TYPE_INT32", "dims": [1]}],
}

#: Triton's ``config.pbtxt`` of each model in its JSON form (what a load's ``config`` carries).
TRITON_CONFIGS: dict[str, dict[str, Any]] = {
    SIMPLE: {
        "name": SIMPLE,
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "sequence_batching": {"control_input": [_control("START", "START"), _control("READY", "READY")]},
        **_TENSORS,
        "instance_group": [{"kind": "KIND_CPU"}],
    },
    DYNA: {
        "name": DYNA,
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "sequence_batching": {
            "max_sequence_idle_microseconds": 10_000_000,
            "oldest": {"max_candidate_sequences": 1024, "max_queue_delay_microseconds": 10_000},
            "control_input": [
                _control("START", "START"),
                _control("END", "END"),
                _control("READY", "READY"),
                _control("CORRID", "CORRID", "TYPE_UINT64"),
            ],
        },
        **_TENSORS,
        "parameters": {"execute_delay_ms": {"string_value": "3"}},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
    },
}
#: Triton's QA makes simple_string_dyna_sequence from simple_dyna_sequence's config with a STRING
#: CORRID; here it is an ONNX model with implicit state, so its config also has a ``state`` block.
TRITON_CONFIGS[STRING_DYNA] = copy.deepcopy(TRITON_CONFIGS[DYNA])
TRITON_CONFIGS[STRING_DYNA]["name"] = STRING_DYNA
TRITON_CONFIGS[STRING_DYNA]["sequence_batching"]["control_input"][3] = _control("CORRID", "CORRID", "TYPE_STRING")
TRITON_CONFIGS[STRING_DYNA]["sequence_batching"]["state"] = [
    {
        "input_name": "ACC_IN",
        "output_name": "ACC_OUT",
        "data_type": "TYPE_INT32",
        "dims": [1],
        "initial_state": [{"name": "zero", "data_type": "TYPE_INT32", "dims": [1], "zero_data": True}],
    }
]
TRITON_CONFIGS[STRING_DYNA]["input"] = [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [-1]}]


def triton_config(name: str, *, string_ids: bool = True) -> dict[str, Any]:
    """Triton's model configuration (JSON form) of model ``name``: a fresh copy to send with a load.
    For a :func:`dyna_accumulator_package` with ``string_ids=False``, the CORRID is TYPE_UINT64."""
    config = copy.deepcopy(TRITON_CONFIGS[name if name in TRITON_CONFIGS else STRING_DYNA])
    config["name"] = name
    if not string_ids and "state" in config["sequence_batching"]:
        config["sequence_batching"]["control_input"][3] = _control("CORRID", "CORRID", "TYPE_UINT64")
    return config


# -- what the models answer ------------------------------------------------------------------------


def _int32(value: int) -> int:
    return (value + 2**31) % 2**32 - 2**31


def expected_outputs(model: str, values: Sequence[int], sequence_id: int | str) -> list[int]:
    """OUTPUT of each step of one sequence of ``model`` sending ``values`` (one INPUT element a
    step, START on the first, END on the last), computed from Triton's description of the model."""
    out: list[int] = []
    acc = 0
    for i, value in enumerate(values):
        start, end = int(i == 0), int(i == len(values) - 1)
        if model == SIMPLE:
            out.append(_int32(value + start))
        elif model == DYNA:
            out.append(_int32(value + start + end * int(sequence_id)))
        else:
            acc = value if start else acc + value
            if end:
                acc += int(sequence_id)
            acc = _int32(acc)
            out.append(acc)
    return out


__all__ = [
    "DYNA",
    "NAMES",
    "SIMPLE",
    "STRING_DYNA",
    "TRITON_CONFIGS",
    "dyna_accumulator_package",
    "expected_outputs",
    "sequence_repository",
    "simple_dyna_sequence_package",
    "simple_sequence_package",
    "triton_config",
]
