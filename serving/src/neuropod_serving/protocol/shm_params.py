"""Triton's shared-memory parameters of a tensor: which region holds it, where, and how many bytes.

A tensor of an inference request (or a requested output) that carries
``shared_memory_region`` and ``shared_memory_byte_size`` (and optionally
``shared_memory_offset``) travels in a region the client registered with the
server beforehand, not in the message. The codecs (:mod:`.inference` for REST,
:mod:`.grpc_codec` for gRPC) read those parameters here into
:class:`SharedTensor` entries of :attr:`InferRequest.shared_memory
<neuropod_serving.protocol.inference.InferRequest.shared_memory>`; the server
(:mod:`neuropod_serving.server.shm_regions`) maps the regions, copies the
inputs out and writes the outputs in.

Pure Python: nothing here touches memory; every fault is a
:class:`~neuropod_serving.errors.ProtocolError` naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from neuropod.spec import TensorSpec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.datatypes import SPEC_DATATYPES, WIRE_DTYPES, oip_datatype, spec_dtype
from neuropod_serving.protocol.fields import show
from neuropod_serving.protocol.shapes import checked_shape

#: The parameter naming the registered region a tensor is in.
REGION = "shared_memory_region"
#: The parameter giving where in the region the tensor starts (optional, 0 when absent).
OFFSET = "shared_memory_offset"
#: The parameter giving how many bytes of the region the tensor takes (or may take, for an output).
BYTE_SIZE = "shared_memory_byte_size"
#: All three: a tensor with any of them is meant to be in shared memory.
KEYS = frozenset({REGION, OFFSET, BYTE_SIZE})
# A BYTES element is at least its 4-byte length.
_LENGTH_BYTES = 4


class SharedTensor(NamedTuple):
    """One tensor in a shared memory region: an input to read, or an output to write."""

    name: str
    region: str
    offset: int
    byte_size: int
    #: An input's datatype and shape, as the request gave them (None for an output).
    datatype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass
class SharedMemoryRequest:
    """The tensors of one request that are in shared memory, by name."""

    inputs: dict[str, SharedTensor] = field(default_factory=dict)
    outputs: dict[str, SharedTensor] = field(default_factory=dict)


def mentions(parameters: Mapping[str, Any]) -> bool:
    """Whether a tensor's parameters say it is in shared memory (any of :data:`KEYS`)."""
    return bool(parameters) and not KEYS.isdisjoint(parameters)


def _placement(kind: str, name: str, parameters: Mapping[str, Any]) -> tuple[str, int, int]:
    """The region, offset and byte size a tensor's parameters give, each checked."""
    region = parameters.get(REGION)
    size = parameters.get(BYTE_SIZE)
    offset = parameters.get(OFFSET, 0)
    if region is None or size is None:
        given = ", ".join(k for k in (REGION, BYTE_SIZE, OFFSET) if k in parameters)
        missing = " and ".join(k for k in (REGION, BYTE_SIZE) if parameters.get(k) is None)
        raise ProtocolError(
            f"{kind} {name!r} has {given} but no {missing}: a tensor in shared memory needs both "
            f"{REGION} and {BYTE_SIZE} ({OFFSET} is optional)"
        )
    if not isinstance(region, str) or not region:
        raise ProtocolError(
            f"{kind} {name!r}: {REGION} must be the name of a registered region (a non-empty string), "
            f"not {show(region)}"
        )
    for key, value in ((BYTE_SIZE, size), (OFFSET, offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"{kind} {name!r}: {key} must be a byte count (an integer >= 0), not {show(value)}")
    return region, offset, size


def shared_input(
    name: str,
    datatype: object,
    shape: object,
    parameters: Mapping[str, Any],
    *,
    spec: TensorSpec | None = None,
    carries: str | None = None,
) -> SharedTensor:
    """The :class:`SharedTensor` of an input whose parameters place it in shared memory.

    :param carries: what else the message gives for this input (``"'data'"``, raw contents...),
        which is refused: the input is in the region or in the message, not both.
    :raises ProtocolError: a missing or wrong parameter, a datatype the spec does not have, a
        shape no array can have, or a byte size that disagrees with shape and datatype.
    """
    region, offset, size = _placement("input", name, parameters)
    if carries is not None:
        raise ProtocolError(
            f"input {name!r} is in shared memory region {region!r} and also has {carries}; send it one way"
        )
    spec_dtype(datatype, tensor=name)  # an unknown datatype is named as such
    if spec is not None and SPEC_DATATYPES.get(spec.dtype) != datatype:
        raise ProtocolError(
            f"tensor {name!r}: datatype {datatype} disagrees with the model's spec ({spec}), "
            f"which needs {oip_datatype(spec.dtype)}"
        )
    assert isinstance(datatype, str)
    dims = checked_shape(shape if isinstance(shape, list) else list(shape) if isinstance(shape, tuple) else shape, name)
    count = math.prod(dims)
    wire = WIRE_DTYPES.get(datatype)
    if wire is not None and size != count * wire.itemsize:
        raise ProtocolError(
            f"input {name!r}: shape {dims} of {datatype} is {count * wire.itemsize} bytes "
            f"({count} x {wire.itemsize}), but {BYTE_SIZE} is {size}"
        )
    if wire is None and size < count * _LENGTH_BYTES:
        raise ProtocolError(
            f"input {name!r}: shape {dims} holds {count} BYTES elements, which take at least "
            f"{count * _LENGTH_BYTES} bytes (a 4-byte length each), but {BYTE_SIZE} is {size}"
        )
    return SharedTensor(name, region, offset, size, datatype, tuple(dims))


def shared_output(name: str, parameters: Mapping[str, Any]) -> SharedTensor:
    """The :class:`SharedTensor` of a requested output to be written into shared memory.

    :raises ProtocolError: a missing or wrong parameter.
    """
    region, offset, size = _placement("output", name, parameters)
    return SharedTensor(name, region, offset, size)


def response_parameters(tensor: SharedTensor, written: int) -> dict[str, Any]:
    """The parameters of an output written to shared memory, as the response carries them
    (instead of its data): where it is, and how many bytes were written."""
    return {REGION: tensor.region, OFFSET: tensor.offset, BYTE_SIZE: written}


__all__ = [
    "BYTE_SIZE",
    "KEYS",
    "OFFSET",
    "REGION",
    "SharedMemoryRequest",
    "SharedTensor",
    "mentions",
    "response_parameters",
    "shared_input",
    "shared_output",
]
