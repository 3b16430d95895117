"""The Open Inference Protocol's datatypes: what spec dtype each means, and how each travels as bytes."""

from __future__ import annotations

from typing import Any

import numpy as np

from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.fields import show

#: OIP datatype -> the spec dtype it means. BYTES carries UTF-8 text, or raw bytes for a spec's ``bytes``
#: tensor (see :data:`SPEC_DATATYPES`).
DATATYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "string",
}
#: Spec dtype -> OIP datatype: ``string`` and ``bytes`` both travel as BYTES (the metadata parameter
#: :data:`~neuropod_serving.protocol.metadata.DTYPE_PARAMETER` tells them apart).
SPEC_DATATYPES: dict[str, str] = {**{dtype: datatype for datatype, dtype in DATATYPES.items()}, "bytes": "BYTES"}


def _wire_dtype(dtype: str) -> np.dtype[Any]:
    """The little-endian dtype of ``dtype``: numpy's own instance of it where the host is
    little-endian (an equal copy from newbyteorder would make every decoded array miss the
    spec's compiled checks, which compare dtypes by identity)."""
    native = np.dtype(dtype)
    little = native.newbyteorder("<")
    return native if little == native else little


#: OIP datatype -> its dtype in binary data: little-endian on the wire whatever the host is.
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    datatype: _wire_dtype(dtype) for datatype, dtype in DATATYPES.items() if dtype != "string"
}
#: OIP datatype -> its numpy dtype in this host's byte order.
NATIVE_DTYPES: dict[str, np.dtype[Any]] = {
    datatype: np.dtype(dtype) for datatype, dtype in DATATYPES.items() if dtype != "string"
}
#: Datatypes whose binary form numpy reads as it is (BOOL needs its 0/1 check).
FAST_DECODE: dict[object, np.dtype[Any]] = {d: w for d, w in WIRE_DTYPES.items() if d != "BOOL"}
#: Numeric datatypes -> (native dtype, the numpy kinds of JSON data it takes, the spec dtype), the
#: kinds as :func:`~neuropod_serving.protocol.tensors.decode_tensor` checks them: true/false for BOOL, integers for integer types.
JSON_TARGETS: dict[object, tuple[np.dtype[Any], str, str]] = {
    d: (n, "b" if d == "BOOL" else "iu" if n.kind in "iu" else "iuf", DATATYPES[d]) for d, n in NATIVE_DTYPES.items()
}


def spec_dtype(datatype: object, *, tensor: str = "?") -> str:
    """The spec dtype an OIP datatype means (``"FP32"`` -> ``"float32"``, ``"BYTES"`` -> ``"string"``).

    :raises ProtocolError: an unknown datatype, or BF16 (no spec dtype holds it).
    """
    if isinstance(datatype, str) and datatype in DATATYPES:
        return DATATYPES[datatype]
    if datatype == "BF16":
        raise ProtocolError(
            f"tensor {tensor!r}: datatype BF16 is not supported (Neuropod specs have no bfloat16); "
            "send FP16 or FP32 instead"
        )
    raise ProtocolError(f"tensor {tensor!r}: datatype {show(datatype)} is not one of {', '.join(DATATYPES)}")


def oip_datatype(dtype: str) -> str:
    """The OIP datatype of a spec dtype (``"float32"`` -> ``"FP32"``, ``"string"`` -> ``"BYTES"``)."""
    try:
        return SPEC_DATATYPES[dtype]
    except KeyError:
        raise ProtocolError(f"spec dtype {dtype!r} has no Open Inference Protocol datatype") from None


def datatype_of(array: np.ndarray[Any, Any], *, tensor: str = "?") -> str:
    """The OIP datatype of a numpy array; unicode and object arrays (of ``str`` or ``bytes``) are BYTES.

    :raises ProtocolError: a dtype the protocol cannot carry (complex, datetime, raw bytes...).
    """
    kind = array.dtype.kind
    if kind in "UO":
        return "BYTES"
    if kind in "biuf":
        try:
            return SPEC_DATATYPES[array.dtype.newbyteorder("=").name]
        except KeyError:
            pass
    raise ProtocolError(
        f"tensor {tensor!r}: numpy dtype {array.dtype} has no Open Inference Protocol datatype; "
        "use bool, (u)int8-64, float16/32/64, str, or an object array of bytes"
    )


