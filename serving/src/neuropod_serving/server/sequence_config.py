"""A load config's ``sequence_batching`` (Triton's JSON form) as a stateful model's serving settings.

Triton declares a stateful model in its model configuration: the inputs its
sequence batcher fills (``control_input``), the state it carries from one
request of a sequence to the next (``state``), how long an idle sequence keeps
it (``max_sequence_idle_microseconds``) and how sequences share runs
(``oldest`` or ``direct``). A load's config carrying that block makes the
package's model stateful as :func:`neuropod.load_neuropod`'s ``sequences``
would (``state_spec`` and ``sequence_controls``), checked against its spec at
load time:

- ``control_input``: one control per input, of kind ``CONTROL_SEQUENCE_START``,
  ``_READY``, ``_END`` (false/true values ``[0, 1]`` in ``int32_false_true``,
  ``fp32_false_true`` or ``bool_false_true``) or ``CONTROL_SEQUENCE_CORRID``.
- ``state``: ``input_name``, ``output_name``, ``data_type``, ``dims`` (whole
  numbers; without the batch dimension when ``max_batch_size`` is above 0, as
  in Triton: one sequence's state is then ``[1, *dims]``) and an
  ``initial_state`` of ``zero_data`` (an initial state from a ``data_file`` is
  refused: package the array with the model instead).
- ``max_sequence_idle_microseconds``: the model's idle limit (0: the server's).
- ``oldest``: ``max_queue_delay_microseconds`` and ``preferred_batch_size`` as
  ``dynamic_batching``'s, ``max_candidate_sequences`` the bound on live
  sequences; ``direct``: ``max_queue_delay_microseconds``.

Every refusal is a :class:`~neuropod_serving.protocol.ProtocolError` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neuropod_serving.errors import ProtocolError

#: Triton's data type names -> spec dtypes.
DTYPES = {
    "TYPE_BOOL": "bool", "TYPE_UINT8": "uint8", "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32",
    "TYPE_UINT64": "uint64", "TYPE_INT8": "int8", "TYPE_INT16": "int16", "TYPE_INT32": "int32",
    "TYPE_INT64": "int64", "TYPE_FP16": "float16", "TYPE_FP32": "float32", "TYPE_FP64": "float64",
    "TYPE_STRING": "string",
}  # fmt: skip
_KINDS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID")
_FIELDS = ("max_sequence_idle_microseconds", "control_input", "state", "oldest", "direct", "iterative_sequence")
_OLDEST = ("max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering")
_DIRECT = ("max_queue_delay_microseconds", "minimum_slot_utilization")
_STATE = ("input_name", "output_name", "data_type", "dims", "initial_state", "use_same_buffer_for_input_output",
          "use_growable_memory")  # fmt: skip
_FLAGS = {"int32_false_true": [0, 1], "fp32_false_true": [0.0, 1.0], "bool_false_true": [False, True]}
#: The longest idle limit a config may set (a day), and the most live sequences.
MAX_IDLE_US = 24 * 3600 * 1_000_000
MAX_SEQUENCES = 1 << 20


@dataclass(frozen=True)
class SequenceSettings:
    """What a ``sequence_batching`` block sets."""

    #: ``load_neuropod``'s ``sequences`` as JSON.
    sequences: str
    #: The idle limit in microseconds; None: the server's.
    max_sequence_idle_us: int | None = None
    #: The bound on live sequences; None: the server's.
    max_sequences: int | None = None
    #: ``oldest``/``direct`` ``max_queue_delay_microseconds``; None: not set.
    max_queue_delay_us: int | None = None
    #: ``oldest.preferred_batch_size``; None: not set.
    preferred_batch_sizes: tuple[int, ...] | None = None


def sequence_settings(block: object, max_batch_size: int, where: str) -> SequenceSettings:
    """The settings of a load config's ``sequence_batching`` block.

    :param max_batch_size: the config's ``max_batch_size`` (0 when it has none): above 0, a
        state's ``dims`` leave out the batch dimension.
    :raises ProtocolError: a field or value this server does not take, naming it.
    """
    where = f"{where}: sequence_batching"
    block = _object(block, where)
    only_fields(block, _FIELDS, where)
    if block.get("iterative_sequence", False) is not False:
        raise ProtocolError(f"{where}.iterative_sequence is not supported (only false)")
    controls = [
        _control(entry, f"{where}.control_input[{i}]") for i, entry in enumerate(_list(block, "control_input", where))
    ]
    states = [
        _state(entry, max_batch_size, f"{where}.state[{i}]") for i, entry in enumerate(_list(block, "state", where))
    ]
    if not controls and not states:
        raise ProtocolError(f"{where} declares no control_input and no state: nothing makes the model stateful")
    idle = whole_number(
        block.get("max_sequence_idle_microseconds", 0), f"{where}.max_sequence_idle_microseconds", 0, MAX_IDLE_US
    )
    delay = bound = None
    preferred: tuple[int, ...] | None = None
    if "oldest" in block and "direct" in block:
        raise ProtocolError(f"{where} has both oldest and direct; a model's sequences are batched one way")
    if "oldest" in block:
        oldest = _object(block["oldest"], f"{where}.oldest")
        only_fields(oldest, _OLDEST, f"{where}.oldest")
        if "max_candidate_sequences" in oldest:
            bound = whole_number(
                oldest["max_candidate_sequences"], f"{where}.oldest.max_candidate_sequences", 1, MAX_SEQUENCES
            )
        if "max_queue_delay_microseconds" in oldest:
            delay = whole_number(oldest["max_queue_delay_microseconds"], f"{where}.oldest.max_queue_delay_microseconds", 0,
                         10_000_000)  # fmt: skip
        if "preferred_batch_size" in oldest:
            sizes = oldest["preferred_batch_size"]
            if not isinstance(sizes, list):
                raise ProtocolError(f"{where}.oldest.preferred_batch_size is a list of batch sizes")
            preferred = tuple(
                sorted({whole_number(n, f"{where}.oldest.preferred_batch_size", 1, 1 << 16) for n in sizes})
            )
        if not isinstance(oldest.get("preserve_ordering", False), bool):
            raise ProtocolError(f"{where}.oldest.preserve_ordering is true or false")
    if "direct" in block:
        direct = _object(block["direct"], f"{where}.direct")
        only_fields(direct, _DIRECT, f"{where}.direct")
        if "max_queue_delay_microseconds" in direct:
            delay = whole_number(direct["max_queue_delay_microseconds"], f"{where}.direct.max_queue_delay_microseconds", 0,
                         10_000_000)  # fmt: skip
    sequences: dict[str, Any] = {}
    if states:
        sequences["state_spec"] = states
    if controls:
        sequences["sequence_controls"] = controls
    return SequenceSettings(
        sequences=json.dumps(sequences), max_sequence_idle_us=idle or None, max_sequences=bound,
        max_queue_delay_us=delay, preferred_batch_sizes=preferred,
    )  # fmt: skip


def check_listed(config: Mapping[str, Any], settings: SequenceSettings, where: str) -> None:
    """Refuse a config whose ``input`` or ``output`` lists a tensor the server fills or keeps:
    Triton's lists leave out the control inputs, and the state inputs and outputs.

    :raises ProtocolError: naming the tensor.
    """
    declared = json.loads(settings.sequences)
    hidden = {
        "input": {c["name"] for c in declared.get("sequence_controls", [])}
        | {p["input_name"] for p in declared.get("state_spec", [])},
        "output": {p["output_name"] for p in declared.get("state_spec", [])},
    }
    for field, names in hidden.items():
        entries = config.get(field)
        listed = {e.get("name") for e in entries if isinstance(e, dict)} if isinstance(entries, list) else set()
        for name in sorted(names & listed):
            raise ProtocolError(
                f"{where}: {field} {name!r} is a control or state tensor of sequence_batching, which the server "
                f"fills or keeps; leave it out of {field}, as Triton's configuration does"
            )


def _control(entry: object, where: str) -> dict[str, str]:
    entry = _object(entry, where)
    only_fields(entry, ("name", "control"), where)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}.name is the name of the input the server fills")
    controls = entry.get("control")
    if not isinstance(controls, list) or len(controls) != 1:
        raise ProtocolError(f"{where}.control is a list of one control (this server fills an input with one kind)")
    control = _object(controls[0], f"{where}.control[0]")
    here = f"{where} ({name!r}).control[0]"
    kind = control.get("kind", "CONTROL_SEQUENCE_START")  # protobuf's JSON leaves out its default, START
    if isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < len(_KINDS):
        kind = _KINDS[kind]
    if kind not in _KINDS:
        raise ProtocolError(f"{here}.kind is one of {', '.join(_KINDS)}, not {kind!r}")
    if kind == "CONTROL_SEQUENCE_CORRID":
        only_fields(control, ("kind", "data_type"), here)
        if control.get("data_type") not in (None, *DTYPES):
            raise ProtocolError(f"{here}.data_type is one of Triton's TYPE_* names, not {control.get('data_type')!r}")
    else:
        flags = [key for key in _FLAGS if key in control]
        only_fields(control, ("kind", *_FLAGS), here)
        if len(flags) != 1:
            raise ProtocolError(f"{here} has one of {', '.join(_FLAGS)} (the input's false and true values)")
        if control[flags[0]] != _FLAGS[flags[0]]:
            raise ProtocolError(
                f"{here}.{flags[0]} must be {_FLAGS[flags[0]]} (this server fills 0 for false and 1 for true), "
                f"not {control[flags[0]]!r}"
            )
    return {"name": name, "kind": str(kind)}


def _state(entry: object, max_batch_size: int, where: str) -> dict[str, Any]:
    entry = _object(entry, where)
    only_fields(entry, _STATE, where)
    pair: dict[str, Any] = {}
    for key in ("input_name", "output_name"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ProtocolError(f"{where}.{key} is the name of the model's state {key.split('_')[0]}")
        pair[key] = entry[key]
    data_type = entry.get("data_type")
    if data_type not in DTYPES:
        raise ProtocolError(f"{where}.data_type is one of Triton's TYPE_* names, not {data_type!r}")
    pair["dtype"] = DTYPES[data_type]
    dims = entry.get("dims")
    if not isinstance(dims, list):
        raise ProtocolError(f"{where}.dims is a list of whole numbers (one sequence's state)")
    shape = [whole_number(d, f"{where}.dims", 1, 1 << 31) for d in dims]
    # As Triton: with max_batch_size above 0 the dims leave out the batch dimension, of 1 for one sequence.
    pair["shape"] = [1, *shape] if max_batch_size > 0 else shape
    initial = entry.get("initial_state", [])
    if not isinstance(initial, list) or len(initial) > 1:
        raise ProtocolError(f"{where}.initial_state is a list of at most one initial state")
    if initial:
        state = _object(initial[0], f"{where}.initial_state[0]")
        only_fields(state, ("data_type", "dims", "zero_data", "data_file", "name"), f"{where}.initial_state[0]")
        if "data_file" in state:
            raise ProtocolError(
                f"{where}.initial_state[0].data_file is not supported: this server loads no files beside the "
                "package; use zero_data, or package the initial state with the model (the packager's "
                "state_spec initial_state array)"
            )
        if state.get("zero_data") is not True:
            raise ProtocolError(f"{where}.initial_state[0] sets zero_data: true (the only initial state taken)")
    pair["initial_state"] = "zero"
    return pair


def _object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} is an object, not {type(value).__name__}")
    return value


def _list(block: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = block.get(key, [])
    if not isinstance(value, list):
        raise ProtocolError(f"{where}.{key} is a list, not {type(value).__name__}")
    return value


def only_fields(value: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Refuse a field of a load config's object that is not one of ``allowed``, naming it."""
    for key in value:
        if key not in allowed:
            raise ProtocolError(f"{where}: field {key!r} is not one this server takes (it takes {', '.join(allowed)})")


def whole_number(value: object, where: str, low: int, high: int) -> int:
    """A whole number from JSON, also as protobuf's JSON writes 64-bit ones (a string of digits)."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{where} is a whole number, not {value!r}")
    if not low <= value <= high:
        raise ProtocolError(f"{where} is {low} to {high:,}, not {value}")
    return value


__all__ = ["DTYPES", "SequenceSettings", "check_listed", "only_fields", "sequence_settings", "whole_number"]
