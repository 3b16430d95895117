"""What an inference request asks of the server besides its tensors.

Three things ride in a request's ``parameters`` (and its requested outputs'):

* ``timeout`` (microseconds, Triton's request timeout): a request still waiting
  for a run slot or in its batch when it passes is answered with an error and
  never run; 0 means none.
* ``classification`` on a requested output (Triton's classification
  extension): instead of the tensor, the top ``k`` entries of each row as
  ``"score:index"`` or ``"score:index:label"`` strings.
* ``sequence_id`` (an integer >= 1 or a non-empty string; 0 and "" mean none),
  ``sequence_start`` and ``sequence_end`` (Triton's sequence extension): the
  request is a step of that sequence of a stateful model
  (:class:`~neuropod.sequences.SequenceStep`). A model that is not stateful
  runs it as any other request, as Triton's schedulers do.
* every other request parameter goes on to the model (see
  :meth:`neuropod.model.NeuropodModel.infer`'s ``parameters``), except those the
  protocol gives to the server (:data:`SERVER_PARAMETERS`, and names starting
  with ``triton_``).

A request that asks none of this has no :class:`RequestOptions` (None), so a
plain request costs nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuropod.sequences import SequenceStep
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.fields import is_int

#: Request parameters the protocol gives to the server (Triton's reserved ones, and those of
#: its extensions): they never reach a model. ``priority`` is accepted and ignored (this server
#: has no priority levels).
SERVER_PARAMETERS = frozenset({
    "timeout", "priority", "sequence_id", "sequence_start", "sequence_end", "headers",
    "binary_data_output", "binary_data", "classification",
    "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
})  # fmt: skip
#: Request parameters starting with this belong to the server too (tritonclient refuses to send them).
SERVER_PREFIX = "triton_"
#: The longest timeout taken, in microseconds (a year): longer ones are this.
MAX_TIMEOUT_US = 365 * 24 * 3600 * 1_000_000


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks besides its tensors (None on a request that asks nothing)."""

    #: Seconds the request may wait for a run slot or its batch; None: no limit.
    timeout_s: float | None = None
    #: The request's ``timeout`` parameter as sent (microseconds), for messages.
    timeout_us: int | None = None
    #: Parameters for the model; None when there are none.
    parameters: Mapping[str, Any] | None = None
    #: Output name -> how many classes to answer (the classification extension); None: no output asks.
    classification: Mapping[str, int] | None = None
    #: The sequence step the request is (Triton's sequence extension); None: none.
    sequence: SequenceStep | None = None


def classification_count(value: object, output: str) -> int:
    """A requested output's ``classification`` parameter: a class count of at least 1.

    :raises ProtocolError: anything else, naming the output.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProtocolError(
            f"output {output!r}: parameters.classification is the number of classes to answer, "
            f"an integer >= 1, not {value!r:.80}"
        )
    return value


def request_options(
    parameters: Mapping[str, Any], classification: Mapping[str, int] | None = None
) -> RequestOptions | None:
    """The :class:`RequestOptions` of a request's ``parameters`` (and its outputs' classification
    counts), or None when it asks nothing of them.

    :raises ProtocolError: a ``timeout`` that is not a count of microseconds >= 0, or a
        parameter for the model that is not a bool, number or string (the protocol's
        parameter types), naming it.
    """
    timeout = parameters.get("timeout")
    timeout_s = None
    if timeout is not None:
        if not is_int(timeout) or timeout < 0:
            raise ProtocolError(
                f"request parameters.timeout is a count of microseconds, an integer >= 0 (0: no timeout), "
                f"not {timeout!r:.80}"
            )
        if timeout > 0:
            timeout_s = min(timeout, MAX_TIMEOUT_US) / 1e6
    model: dict[str, Any] = {}
    for key, value in parameters.items():
        if key in SERVER_PARAMETERS or key.startswith(SERVER_PREFIX):
            continue
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ProtocolError(
                f"request parameter {key!r} must be a bool, number or string (the protocol's parameter "
                f"types), not {type(value).__name__}"
            )
        model[key] = value
    sequence = sequence_step(parameters)
    if timeout_s is None and not model and not classification and sequence is None:
        return None
    return RequestOptions(
        sequence=sequence,
        timeout_s=timeout_s,
        timeout_us=timeout if timeout_s is not None else None,
        parameters=model or None,
        classification=dict(classification) if classification else None,
    )


def sequence_step(parameters: Mapping[str, Any]) -> SequenceStep | None:
    """The sequence step of a request's ``sequence_id``, ``sequence_start`` and ``sequence_end``
    parameters; None when it names no sequence (no id, 0 or "").

    :raises ProtocolError: an id that is not an integer in [0, 2**64) or a string, a flag that is
        not a bool, or a flag without an id, naming it.
    """
    sequence_id = parameters.get("sequence_id")
    start = parameters.get("sequence_start", False)
    end = parameters.get("sequence_end", False)
    for name, flag in (("sequence_start", start), ("sequence_end", end)):
        if not isinstance(flag, bool):
            raise ProtocolError(f"request parameter {name} must be a bool (true or false), not {flag!r:.80}")
    if sequence_id is None or sequence_id == 0 or sequence_id == "":
        if start or end:
            raise ProtocolError(
                "request parameters sequence_start / sequence_end need a sequence_id (a non-zero integer or a "
                "non-empty string) naming the sequence"
            )
        return None
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
        raise ProtocolError(
            f"request parameter sequence_id must be an integer or a string, not {type(sequence_id).__name__}"
        )
    if isinstance(sequence_id, int) and not 0 < sequence_id < 1 << 64:
        raise ProtocolError(f"request parameter sequence_id {sequence_id} is out of range: 1 to 2**64-1")
    return SequenceStep(sequence_id, start, end)


def require_sequence(model: str, options: RequestOptions | None) -> None:
    """Refuse a request to stateful model ``model`` that names no sequence, in Triton's words.

    :raises ProtocolError: ``options`` names no sequence (400).
    """
    if options is None or options.sequence is None:
        raise ProtocolError(
            f"inference request to model {model!r} must specify a non-zero or non-empty correlation ID: the "
            "model is stateful, so each request is a step of a sequence named by the request parameter "
            "sequence_id (with sequence_start on its first step)"
        )


#: Entries formatted in one call while classifying: each call holds the interpreter for its
#: length (about 10 ms for this many), so a classification in a worker thread lets the event
#: loop's thread run between calls.
_FORMAT_CHUNK = 32_768


def classify(
    array: np.ndarray[Any, Any], count: int, labels: Sequence[str] | None, batched: bool
) -> np.ndarray[Any, Any]:
    """The classification extension's answer for one output: the ``count`` highest entries
    (fewer when a row has fewer) as ``"score:index"`` / ``"score:index:label"`` strings,
    highest first (equal scores: lower index first; NaN above every number).

    Vectorised: the top entries are chosen with a partition when they are few (a full sort
    only when most of a row is asked for), and formatted in chunks of :data:`_FORMAT_CHUNK`.

    :param batched: the output's first dim is the batch: each row (the rest of the dims,
        flattened) is ranked on its own and the answer is ``[rows, count]``; else the whole
        tensor is one row and the answer is ``[count]``.
    :param labels: label ``i`` names index ``i`` (an index past the labels gets none).
    """
    if batched and array.ndim >= 1:
        rows = array.reshape(array.shape[0], -1)
        shape: tuple[int, ...] = (array.shape[0],)
    else:
        rows = array.reshape(1, -1)
        shape = ()
    k = min(count, rows.shape[1])
    order = _top(rows, k)
    scores = np.take_along_axis(rows, order, axis=1).ravel()
    if array.dtype.kind != "f":
        scores = scores.astype(np.int64 if array.dtype.kind != "u" else np.uint64)
    columns = [scores.tolist(), order.ravel().tolist()]
    pattern = "%f:%d" if array.dtype.kind == "f" else "%d:%d"
    if labels:
        named = np.array([*(f":{label}" for label in labels), ""], dtype=object)
        columns.append(named[np.minimum(order.ravel(), len(labels))].tolist())
        pattern += "%s"
    texts: list[str] = []
    total = len(columns[0])
    for begin in range(0, total, _FORMAT_CHUNK):
        texts += map(pattern.__mod__, zip(*(c[begin : begin + _FORMAT_CHUNK] for c in columns)))
    out = np.empty(total, dtype=object)
    out[:] = texts
    return out.reshape((*shape, k))


def _top(rows: np.ndarray[Any, Any], k: int) -> np.ndarray[Any, Any]:
    """The columns of the ``k`` highest entries of each row, highest first (ties: lower column)."""
    n = rows.shape[1]
    if k == 0:
        return np.zeros((len(rows), 0), dtype=np.intp)
    if 4 * k < n:
        # The k-th highest of each row (NaN sorts above numbers, as in a sort), then every
        # entry above it and the lowest columns of those equal to it: exactly k a row, or a
        # NaN at the boundary, which the full sort below settles.
        kth = np.take_along_axis(rows, np.argpartition(rows, n - k, axis=1)[:, n - k : n - k + 1], axis=1)
        above = rows > kth
        if rows.dtype.kind == "f":
            above |= np.isnan(rows)
        equal = rows == kth
        chosen = above | (equal & (np.cumsum(equal, axis=1) <= (k - above.sum(axis=1))[:, None]))
        if int(chosen.sum()) == len(rows) * k:
            columns = np.nonzero(chosen)[1].reshape(len(rows), k)
            return np.take_along_axis(columns, _descending(np.take_along_axis(rows, columns, axis=1)), axis=1)
    return _descending(rows)[:, :k]


def _descending(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each row's columns by value, highest first, equal values by column: a stable ascending sort
    of each reversed row, read backwards."""
    n = rows.shape[1]
    columns: np.ndarray[Any, Any] = n - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1]
    return columns


__all__ = [
    "MAX_TIMEOUT_US",
    "SERVER_PARAMETERS",
    "SERVER_PREFIX",
    "RequestOptions",
    "classification_count",
    "classify",
    "request_options",
    "require_sequence",
    "sequence_step",
]
