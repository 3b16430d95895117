"""Model and tensor metadata (``GET /v2/models/{name}``) <-> Neuropod spec entries."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from neuropod import _json
from neuropod.errors import PackageError
from neuropod.spec import TensorSpec, parse_spec
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.datatypes import oip_datatype, spec_dtype
from neuropod_serving.protocol.fields import is_int, kind_of, show

#: The metadata parameter that carries a tensor's exact spec shape, as a JSON string.
SHAPE_PARAMETER = "neuropod_shape"
#: The metadata parameter that marks a BYTES tensor of raw bytes: ``"bytes"`` (a BYTES tensor without it is text).
DTYPE_PARAMETER = "neuropod_dtype"


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    """The OIP metadata of one spec entry: symbol and null dims are -1, and
    ``parameters.neuropod_shape`` holds the exact spec shape as a JSON string;
    a ``bytes`` tensor is BYTES with ``parameters.neuropod_dtype`` ``"bytes"``."""
    parameters = {SHAPE_PARAMETER: json.dumps(list(spec.shape))}
    if spec.dtype == "bytes":
        parameters[DTYPE_PARAMETER] = "bytes"
    return {
        "name": spec.name,
        "datatype": oip_datatype(spec.dtype),
        "shape": [d if isinstance(d, int) else -1 for d in spec.shape],
        "parameters": parameters,
    }


def spec_from_metadata(metadata: object, *, where: str = "tensor metadata") -> TensorSpec:
    """Rebuild a spec entry from OIP tensor metadata.

    With ``parameters.neuropod_shape`` (a neuropod server) the exact spec comes
    back; without it (any other server) each -1 becomes ``None``. BYTES is
    ``string`` unless ``parameters.neuropod_dtype`` says ``"bytes"``.

    :raises ProtocolError: naming the field that is wrong.
    """
    if not isinstance(metadata, Mapping):
        raise ProtocolError(f"{where} must be an object with name, datatype and shape, not {kind_of(metadata)}")
    name = metadata.get("name")
    if not isinstance(name, str):
        raise ProtocolError(f"{where}: 'name' must be a string, not {show(name)}")
    where = f"{where} {name!r}"
    dtype = spec_dtype(metadata.get("datatype"), tensor=name)
    shape = metadata.get("shape")
    if not isinstance(shape, list) or not all(is_int(d) and d >= -1 for d in shape):
        raise ProtocolError(f"{where}: 'shape' must be a list of sizes >= 0 or -1 (any size), not {show(shape)}")
    dims: list[int | str | None] = [None if d == -1 else d for d in shape]
    parameters = metadata.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise ProtocolError(f"{where}: 'parameters' must be an object, not {kind_of(parameters)}")
    if SHAPE_PARAMETER in parameters:
        dims = _exact_shape(parameters[SHAPE_PARAMETER], shape, where)
    if DTYPE_PARAMETER in parameters:
        marked = parameters[DTYPE_PARAMETER]
        if marked != "bytes" or dtype != "string":
            raise ProtocolError(
                f"{where}: parameters.{DTYPE_PARAMETER} may only say \"bytes\", of a BYTES tensor; it says {show(marked)} "
                f"of {show(metadata.get('datatype'))}"
            )
        dtype = "bytes"
    try:
        return parse_spec([{"name": name, "dtype": dtype, "shape": dims}], where)[0]
    except PackageError as e:
        raise ProtocolError(str(e)) from None


def _exact_shape(value: object, shape: list[int], where: str) -> list[int | str | None]:
    problem = f"{where}: parameters.{SHAPE_PARAMETER} must be a JSON list matching shape {shape}"
    try:
        dims = _json.loads(value) if isinstance(value, str) else None
    except ValueError as e:
        raise ProtocolError(f"{problem}, but it is not JSON ({e}): {show(value)}") from None
    if not isinstance(dims, list) or len(dims) != len(shape):
        raise ProtocolError(f"{problem}, not {show(value)}")
    for i, (dim, size) in enumerate(zip(dims, shape)):
        ok = (dim == size) if size >= 0 else (dim is None or isinstance(dim, str))
        if not ok or isinstance(dim, bool):
            raise ProtocolError(f"{problem}: entry {i} is {show(dim)} where shape says {size}")
    return dims


def model_metadata(
    name: str,
    input_spec: Iterable[TensorSpec],
    output_spec: Iterable[TensorSpec],
    *,
    platform: str,
    versions: Sequence[str] = (),
) -> dict[str, Any]:
    """The body of ``GET /v2/models/{name}``: the model's inputs and outputs as OIP tensor metadata."""
    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": [tensor_metadata(s) for s in input_spec],
        "outputs": [tensor_metadata(s) for s in output_spec],
    }


def specs_from_model_metadata(metadata: object) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The input and output specs in a model metadata body (see :func:`spec_from_metadata`)."""
    if not isinstance(metadata, Mapping):
        raise ProtocolError(f"model metadata must be an object, not {kind_of(metadata)}")
    specs: list[tuple[TensorSpec, ...]] = []
    for key in ("inputs", "outputs"):
        entries = metadata.get(key, [])
        if not isinstance(entries, list):
            raise ProtocolError(f"model metadata: {key!r} must be a list, not {kind_of(entries)}")
        specs.append(tuple(spec_from_metadata(e, where=f"model metadata {key}[{i}]") for i, e in enumerate(entries)))
    return specs[0], specs[1]



def specs_by_name(spec: Iterable[TensorSpec] | Mapping[str, TensorSpec] | None) -> Mapping[str, TensorSpec] | None:
    """A spec (a sequence of tensors, or already a dict of them by name) as a dict by name."""
    if spec is None or type(spec) is dict:
        return spec
    return {s.name: s for s in cast("Iterable[TensorSpec]", spec)}


