"""Routing a stateful model's sequences on Ray Serve: every step of a sequence reaches the replica
that holds its state, and a step whose replica is gone fails with a clear error.

:class:`SequenceRouter` is the deployment's Ray Serve request router (``request_router_config``).
A request that is a sequence's step goes to one replica, chosen so:

- a sequence this router has routed before goes where it went (its replica holds the state; a
  restart, ``sequence_start`` for a live id, too);
- its first step (``sequence_start``), or a step of a sequence this router has not seen (another
  proxy or handle routed its start), goes to the replica that ranks first for its id among all
  replicas (rendezvous hashing on the replica ids: every router picks the same one while the
  replicas are the same);
- a step of a sequence whose replica is gone (it died, or was stopped) without ``sequence_start``
  is marked lost: the replica that gets it refuses it with a :class:`~neuropod.errors.SequenceError`
  saying the replica holding its state is gone (see :func:`lost_message`), instead of running it
  from the initial state.

Other requests take Ray's default routing (power of two choices).

Where a request's sequence is read: a handle call's keywords (``handle.infer.remote(inputs,
sequence_id=..., sequence_start=..., sequence_end=...)``); a gRPC ``ModelInfer`` request's
parameters (Ray's gRPC proxy hands the request's bytes over); an HTTP request's
``Neuropod-Sequence`` header (Ray's HTTP proxy routes a request before reading its body:
remote models send the header with every step; other REST clients add it, else their steps are
routed as any request, which is right only with one replica).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from neuropod.errors import SequenceError
from neuropod_serving.client._http import SEQUENCE_HEADER
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

#: The request parameter (gRPC), header (HTTP) or handle keyword that marks a lost step; its
#: value is the id of the replica that held the sequence's state.
LOST_PARAMETER = "neuropod_sequence_lost"
LOST_HEADER = b"neuropod-sequence-lost"
LOST_KEYWORD = "_sequence_lost"
#: Sequences one router remembers (least recently used forgotten first).
MAX_REMEMBERED = 100_000

_HEADER = SEQUENCE_HEADER.lower().encode("latin-1")


def lost_message(sequence_id: Any, replica: str) -> str:
    """The error of a step whose sequence's replica is gone."""
    return (
        f"sequence {sequence_id!r} is lost: the replica that held its state ({replica}) is gone (it died or "
        "was stopped), and its state with it. Start the sequence again (sequence_start=True)"
    )


def lost_error(sequence_id: Any, replica: str) -> SequenceError:
    return SequenceError(lost_message(sequence_id, replica))


class SequenceRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Ray Serve's router for a neuropod deployment: a sequence's steps to the replica holding its
    state (see the module's text), other requests as Ray routes them."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        #: sequence key -> the unique id of the replica that holds its state.
        self._homes: OrderedDict[str, str] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        step = None if pending_request is None else sequence_step(pending_request)
        if step is None or not candidate_replicas:
            return list(await super().choose_replicas(candidate_replicas, pending_request))
        assert pending_request is not None
        sequence_id, start, end = step
        key = json.dumps(sequence_id)
        replicas = {r.replica_id.unique_id: r for r in candidate_replicas}
        homes = getattr(self, "_homes", None)
        if homes is None:
            homes = self._homes = OrderedDict()
        home = homes.get(key)
        # A live sequence's steps, a restart (sequence_start) too, go where its state is.
        chosen = replicas.get(home) if home is not None else None
        if chosen is None:
            chosen = _ranked_first(key, candidate_replicas)
            if home is not None and not start:
                # Its replica is gone: the step goes to one that refuses it, saying so.
                mark_lost(pending_request, home)
                return [[chosen]]
        if end:
            homes.pop(key, None)
        else:
            homes[key] = chosen.replica_id.unique_id
            homes.move_to_end(key)
            while len(homes) > MAX_REMEMBERED:
                homes.popitem(last=False)
        return [[chosen]]


def _ranked_first(key: str, replicas: list[RunningReplica]) -> RunningReplica:
    """The replica that ranks first for ``key`` (rendezvous hashing: the same on every router)."""

    def score(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{key}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest()

    return max(replicas, key=score)


def sequence_step(request: PendingRequest) -> tuple[int | str, bool, bool] | None:
    """The sequence step a request is, ``(id, start, end)``; None when it names none (or cannot be read)."""
    try:
        kwargs = request.kwargs
        if kwargs and kwargs.get("sequence_id") is not None:
            return _step(kwargs.get("sequence_id"), kwargs.get("sequence_start"), kwargs.get("sequence_end"))
        if len(request.args) != 1 or not isinstance(request.args[0], bytes):
            return None
        method = request.metadata.call_method
        if method == "ModelInfer":
            params = grpc_parameters(pickle.loads(request.args[0]).user_request_proto)  # noqa: S301 - Ray's proxy pickled it
            if "sequence_id" not in params:
                return None
            return _step(params.get("sequence_id"), params.get("sequence_start"), params.get("sequence_end"))
        if method == "__call__":
            scope = pickle.loads(request.args[0]).asgi_scope  # noqa: S301 - Ray's proxy pickled it
            for name, value in scope.get("headers") or ():
                if name == _HEADER:
                    found = json.loads(value)
                    if isinstance(found, list) and len(found) == 3:
                        return _step(*found)
    except Exception:  # noqa: BLE001 - a request that cannot be read is routed as any request
        return None
    return None


def _step(sequence_id: Any, start: Any, end: Any) -> tuple[int | str, bool, bool] | None:
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)) or sequence_id in (0, ""):
        return None
    return sequence_id, start is True, end is True


def grpc_parameters(data: bytes) -> dict[str, Any]:
    """A serialized ModelInferRequest's ``parameters`` (field 4), its tensors' bytes skipped."""
    entries = bytearray()
    pos, size = 0, len(data)
    while pos < size:
        start = pos
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return {}
        if field == 4:
            entries += data[start:pos]
    message = pb.ModelInferRequest.FromString(bytes(entries))
    found: dict[str, Any] = {}
    for name, param in message.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            found[name] = getattr(param, which)
    return found


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def mark_lost(request: PendingRequest, replica: str) -> None:
    """Mark ``request`` as a step of a sequence whose replica (``replica``) is gone: the replica that
    gets it refuses it (:func:`lost_error`)."""
    if request.kwargs is not None and request.kwargs.get("sequence_id") is not None:
        request.kwargs[LOST_KEYWORD] = replica
        return
    arg = pickle.loads(request.args[0])  # noqa: S301 - Ray's proxy pickled it
    if request.metadata.call_method == "ModelInfer":
        extra = pb.ModelInferRequest(parameters={LOST_PARAMETER: pb.InferParameter(string_param=replica)})
        # Serialized messages concatenated merge: the request gains the parameter.
        arg.user_request_proto = bytes(arg.user_request_proto) + extra.SerializeToString()
    else:
        headers = [h for h in arg.asgi_scope.get("headers") or () if h[0] != LOST_HEADER]
        arg.asgi_scope["headers"] = [*headers, (LOST_HEADER, replica.encode("latin-1", "replace"))]
    request.args = [pickle.dumps(arg), *request.args[1:]]


__all__ = [
    "LOST_HEADER",
    "LOST_KEYWORD",
    "LOST_PARAMETER",
    "SequenceRouter",
    "grpc_parameters",
    "lost_error",
    "lost_message",
    "sequence_step",
]
