"""Tensors of the gRPC inference messages <-> numpy arrays: raw contents, typed contents and parameters."""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol.datatypes import DATATYPES, FAST_DECODE, spec_dtype
from neuropod_serving.protocol.shapes import MAX_DIMS, checked_shape, spannable
from neuropod_serving.protocol.tensors import decode_tensor, encode_tensor

# Which typed field of InferTensorContents holds each datatype (FP16 has none: raw only).
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_CONTENTS_FIELDS = tuple(dict.fromkeys(_CONTENTS_FIELD.values()))
#: Field numbers of the raw contents in the proto (checked against the descriptor in the tests).
RAW_INPUT_FIELD = 7
RAW_OUTPUT_FIELD = 6

#: The fast path for numbers out: datatype by numpy dtype where the host's is the
#: wire's (little-endian), so that tobytes() is already what goes out.
FAST_ENCODE: dict[np.dtype[Any], str] = (
    {np.dtype(dtype): datatype for datatype, dtype in DATATYPES.items() if dtype != "string"}
    if sys.byteorder == "little"
    else {}
)



def parameters_from_proto(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as a plain dict of bool, int, float and str."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(value, choice)
    return out


def fill_parameters(target: Any, parameters: Mapping[str, Any]) -> None:
    for key, value in parameters.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            param.int64_param = value
        elif isinstance(value, int) and 0 <= value < 2**64:
            param.uint64_param = value
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise ProtocolError(
                f"parameter {key!r}: gRPC parameters are bool, int64, uint64, float or str, not {value!r}"
            )


def encode_tensors(
    arrays: Mapping[str, np.ndarray[Any, Any]], kind: Any, *, views: bool = False
) -> tuple[list[Any], list[Any]]:
    """Tensor messages and their raw bytes; with ``views``, a C-contiguous
    numeric array's bytes are its own memory (no copy)."""
    tensors: list[Any] = []
    raws: list[Any] = []
    for name, array in arrays.items():
        datatype = FAST_ENCODE.get(array.dtype) if isinstance(array, np.ndarray) else None
        if datatype is not None:
            # tobytes() is row-major whatever the strides; the dtype is already the wire's.
            tensors.append(kind(name=name, datatype=datatype, shape=array.shape))
            raws.append(array.data if views and array.ndim and array.flags.c_contiguous else array.tobytes())
            continue
        obj, raw = encode_tensor(name, array, binary=True)
        tensors.append(kind(name=name, datatype=obj["datatype"], shape=obj["shape"]))
        assert raw is not None  # binary=True always gives the raw bytes
        raws.append(raw)
    return tensors, raws


def decode_tensors(
    tensors: Sequence[Any], raws: Sequence[Any], kind: str, specs: Mapping[str, TensorSpec] | None,
    exact: Collection[str] = (),
) -> dict[str, np.ndarray[Any, Any]]:
    """The tensors of a message as arrays; BYTES of a ``bytes`` spec entry, or named in ``exact``, as the bytes sent."""
    field = f"raw_{kind}_contents"
    if raws and len(raws) != len(tensors):
        raise ProtocolError(
            f"{field} has {len(raws)} entries but the message has {len(tensors)} {kind}s: "
            f"with raw contents, every {kind} needs exactly one entry, in the order of the {kind}s"
        )
    raws = list(raws)  # indexing a protobuf repeated field costs more than a list's
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for i, t in enumerate(tensors):
        name = t.name
        if not name:
            raise ProtocolError(f"{kind}s[{i}]: 'name' must be a non-empty string")
        if name in arrays:
            raise ProtocolError(f"{kind} {name!r} appears twice; each {kind} is sent once")
        spec = None
        if specs is not None:
            spec = specs.get(name)
            if spec is None:
                raise ProtocolError(
                    f"{kind} {name!r} is not one of this model's {kind}s: {', '.join(specs) or '(none)'}"
                )
        datatype = t.datatype
        if raws:
            # The common case without building the codec's tensor object; anything
            # unusual (or wrong) goes the full way below, which words the error.
            wire = FAST_DECODE.get(datatype)
            if wire is not None and (spec is None or spec.dtype == DATATYPES[datatype]):
                shape = tuple(t.shape)
                raw = raws[i]
                if (
                    len(shape) <= MAX_DIMS
                    and min(shape, default=0) >= 0
                    and math.prod(shape) * wire.itemsize == len(raw)
                    and spannable(shape)
                    and not has_contents(t)
                ):
                    arrays[name] = np.frombuffer(raw, dtype=wire).reshape(shape)
                    continue
        obj: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(t.shape)}
        where = f"{kind}s[{i}]"
        if raws:
            if has_contents(t):
                raise ProtocolError(
                    f"{kind} {name!r} has typed contents while the message uses {field}; "
                    "send every tensor one way (raw contents, which tritonclient sends, or typed contents)"
                )
            arrays[name] = decode_tensor(
                obj, binary=memoryview(raws[i]), spec=spec, where=where, size_name=f"the size of {field}[{i}]",
                exact=name in exact,
            )
        else:
            raw_bytes = name in exact or (spec is not None and spec.dtype == "bytes")
            obj["data"] = _typed_contents(t, kind, exact=raw_bytes)
            arrays[name] = decode_tensor(obj, spec=spec, where=where, exact=raw_bytes)
    return arrays


def has_contents(tensor: Any) -> bool:
    """Whether a tensor carries typed contents. MLServer sets an empty ``contents`` beside raw
    contents, so a present but empty message does not count."""
    return bool(tensor.HasField("contents") and tensor.contents.ListFields())


def _typed_contents(tensor: Any, kind: str, *, exact: bool = False) -> list[Any]:
    """A tensor's typed contents as the codec's JSON ``data`` (a flat list), checked for the right field and count;
    BYTES as str (UTF-8 text only), or as the bytes sent for a bytes tensor (``exact``)."""
    name = tensor.name
    datatype = tensor.datatype
    spec_dtype(datatype, tensor=name)  # an unknown datatype is named as such, not as a missing field
    contents = tensor.contents
    filled = [f for f in _CONTENTS_FIELDS if len(getattr(contents, f))]
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"{kind} {name!r}: {datatype} has no typed contents field; send it as raw contents")
    wrong = [f for f in filled if f != field]
    if wrong:
        raise ProtocolError(
            f"{kind} {name!r}: {datatype} contents go in {field}, but the message filled {', '.join(wrong)}"
        )
    values = getattr(contents, field)
    count = math.prod(checked_shape(list(tensor.shape), name))
    if len(values) != count:
        raise ProtocolError(
            f"{kind} {name!r}: shape {list(tensor.shape)} holds {count} elements, but {field} has {len(values)}"
            + ("" if tensor.HasField("contents") else " (the message has neither raw nor typed contents for it)")
        )
    if datatype != "BYTES" or exact:
        return list(values)
    texts: list[str] = []
    for i, raw in enumerate(values):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ProtocolError(
                f"{kind} {name!r}: BYTES element {i} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    return texts
