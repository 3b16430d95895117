"""The Ray Serve deployment: one replica serving one package over REST and gRPC."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from neuropod import load_neuropod
from neuropod.errors import NeuropodError
from neuropod.pipelines import PipelineModel
from neuropod_serving.defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_SEQUENCE_IDLE_US, DEFAULT_MAX_SEQUENCES
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.options import request_options
from neuropod_serving.ray._extra import ray, serve
from neuropod_serving.ray.metrics import RayMetrics
from neuropod_serving.ray.packages import PackageRef, fetch
from neuropod_serving.ray.sequence_router import LOST_HEADER, LOST_PARAMETER, grpc_parameters, lost_error, lost_message
from neuropod_serving.ray.streaming import handle_stream, model_stream_infer
from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, ServedModel, create_app
from neuropod_serving.server.grpc_service import METHODS, Servicer, authenticate, status_of
from neuropod_serving.server.sequence_batching import SequenceLimits

log = logging.getLogger("neuropod_serving.ray")

#: The name of the deployment in every application :func:`build` makes.
DEPLOYMENT_NAME = "NeuropodModel"


class _TooLarge(Exception):
    """A gRPC request over ``max_request_bytes`` (RESOURCE_EXHAUSTED)."""


class _Serialized:
    """Bytes the servicer already serialized, in the form Ray's replica sends gRPC answers."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


def _absolute_paths(app: Any, stateful: bool = False) -> Any:
    """``app`` seeing every path whole: Ray sets ``root_path`` to the application's route
    prefix, and the Open Inference Protocol's routes are absolute (``/v2/models/...``). For a
    stateful model, a step the router marked lost (its sequence's replica is gone) is refused
    with 400 and the reason."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("root_path"):
            scope = {**scope, "root_path": ""}
        if stateful and scope.get("type") == "http":
            lost = _lost_http_step(scope)
            if lost is not None:
                body = json.dumps({"error": lost}).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return asgi


def _lost_http_step(scope: Any) -> str | None:
    """Why an HTTP request is refused: the router marked it a step of a lost sequence (None: it did not)."""
    headers = dict(scope.get("headers") or ())
    replica = headers.get(LOST_HEADER)
    if replica is None:
        return None
    try:
        sequence_id = json.loads(headers.get(b"neuropod-sequence", b"[null]"))[0]
    except (ValueError, IndexError, TypeError):
        sequence_id = None
    return lost_message(sequence_id, replica.decode("latin-1"))


@serve.ingress()
class NeuropodDeployment:
    """One replica: one package, loaded once, served over REST (``neuropod serve``'s app) and
    gRPC (its servicer's methods, named as the protocol's RPCs for Ray's gRPC proxy)."""

    async def __init__(self, package: PackageRef, options: Mapping[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        self._options = dict(options)
        context = serve.get_replica_context()
        self._replica = context.replica_id.unique_id
        self._path = await fetch(package)
        load_options = dict(self._options.get("load_options") or {})
        workers = int(self._options.get("workers", 1))
        if workers > 1:
            load_options.update(use_ope=True, workers=workers)
        if not self._options.get("gpu") and "device" not in load_options:
            # No GPU was reserved for this replica: never take one Ray may give another.
            load_options["device"] = "cpu"
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(None, lambda: load_neuropod(self._path, **load_options))
        try:
            served = ServedModel(model, self._path)
            registry = ModelRegistry([served], load_options=load_options)
            batch = int(self._options.get("max_batch_size", 1))
            batching = BatchPolicy(batch, int(self._options.get("max_queue_delay_us", 0)) / 1e6) if batch > 1 else None
            self._metrics = metrics = RayMetrics(self._replica, context.app_name)
            if isinstance(model, PipelineModel):
                metrics.watch_steps(served.name, model.step_statistics)
            sequences = SequenceLimits(
                int(self._options.get("max_sequence_idle_us", DEFAULT_MAX_SEQUENCE_IDLE_US)),
                int(self._options.get("max_sequences", DEFAULT_MAX_SEQUENCES)),
            )
            self._engine = Engine(registry, batching=batching, metrics=metrics, sequences=sequences)
        except BaseException:
            model.close()
            raise
        self._servicer = Servicer(self._engine)
        #: Whether the model runs in sequences: their steps are routed by SequenceRouter, which marks lost ones.
        self._stateful = bool(self._options.get("stateful")) or model.stateful
        self._max_request_bytes = int(self._options.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
        token = self._options.get("auth_token")
        self._expected_auth = None if not token else f"Bearer {token}".encode()
        log.info(
            "replica %s serves %r (%s on %s) from %s",
            self._replica, model.name, model.backend.id, model.device, package.source,
        )  # fmt: skip

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(
            self._engine,
            auth_token=self._options.get("auth_token") or None,
            max_request_bytes=self._max_request_bytes,
        )
        return _absolute_paths(app, self._stateful)

    def info(self) -> dict[str, Any]:
        """Where this replica runs and what it serves (for operators and tests)."""
        (served,) = list(self._engine.registry)
        model = served.model
        runtime = ray.get_runtime_context()
        table = getattr(model, "_sequences", None)
        return {
            "replica": self._replica,
            "actor_name": runtime.get_actor_name(),
            "pid": os.getpid(),
            "node_id": runtime.get_node_id(),
            "model": model.name,
            "backend": model.backend.id,
            "device": model.device,
            "package_path": str(self._path),
            "batched": self._engine.batched(model.name)[0],
            "live_sequences": model.live_sequences,
            # The first live sequences' ids (a stateful model in this process): which replica holds which.
            "sequences": list(table.ids())[:1000] if table is not None else [],
            # A pipeline's steps: runs, failures and nanoseconds of each in this replica.
            "steps": model.step_statistics() if isinstance(model, PipelineModel) else {},
        }

    async def infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, Any] | None = None, *, sequence_id: int | str | None = None,
        sequence_start: bool = False, sequence_end: bool = False, _sequence_lost: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The model's outputs for ``inputs`` (numpy arrays), for Ray's handles:
        ``handle.infer.remote(inputs)``; a stateful model's step with ``sequence_id=``,
        ``sequence_start=``, ``sequence_end=`` (the deployment's router sends every step of a
        sequence to the replica holding its state).

        :raises SequenceError: the sequence is not live here, or its replica is gone.
        """
        if _sequence_lost is not None:
            raise lost_error(sequence_id, _sequence_lost)
        (served,) = list(self._engine.registry)
        if not isinstance(inputs, Mapping):
            raise NeuropodError(f"infer takes a dict of input name to numpy array, not {type(inputs).__name__}")
        params = dict(parameters or {})
        if sequence_id is not None:
            params.update(sequence_id=sequence_id, sequence_start=bool(sequence_start), sequence_end=bool(sequence_end))
        options = request_options(params) if params else None
        requested = None if requested_outputs is None else list(requested_outputs)
        try:
            return await self._engine.infer(served, dict(inputs), requested, options)
        except Exception:
            self._metrics.steps(served.name)  # a failed run's steps (a good one's are exported as it ends)
            raise

    async def infer_stream(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """The model's responses to ``inputs`` (numpy arrays) as it makes them, for Ray's streaming
        handles: ``handle.options(stream=True).infer_stream.remote(inputs)`` (a decoupled model's
        any number, any other model's one answer). Cancelling the call closes the model's generator."""
        async for outputs in handle_stream(self._engine, inputs, requested_outputs, parameters):
            yield outputs

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    # The Open Inference Protocol's RPCs, by their names: Ray's gRPC proxy calls the method named as the RPC,
    # with the request's bytes (add_inference_servicer registers no parser) and the call's context.

    async def _rpc(self, method: str, data: bytes, grpc_context: Any) -> Any:
        spec = METHODS[method]
        request: Any = None
        try:
            if self._expected_auth is not None and not spec.open:
                authenticate(grpc_context, self._expected_auth)
            if len(data) > self._max_request_bytes:
                # neuropod serve's grpcio refuses these before a handler sees them; Ray's proxy takes up to 2 GiB.
                raise _TooLarge(
                    f"the request is {len(data):,} bytes, more than this server's limit of "
                    f"{self._max_request_bytes:,} (max_request_bytes)"
                )
            if self._stateful and method == "ModelInfer":
                params = grpc_parameters(data)
                if LOST_PARAMETER in params:
                    raise lost_error(params.get("sequence_id"), str(params[LOST_PARAMETER]))
            request = _parse(spec, data)
            handler = getattr(self._servicer, spec.handler)
            if method == "ModelInfer":
                return _Serialized(await self._servicer.model_infer_async(request, grpc_context))
            return handler(request, grpc_context)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status (status_of logs the unexpected)
            model = spec.model_of(request) if spec.model_of is not None and request is not None else "?"
            code, details = (
                (grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                if isinstance(e, _TooLarge)
                else status_of(e, method, model)
            )
            grpc_context.set_code(code)
            grpc_context.set_details(details)
            return _Serialized(b"")

    async def ServerLive(self, request: bytes, grpc_context: Any) -> Any:  # named as the RPC
        return await self._rpc("ServerLive", request, grpc_context)

    async def ServerReady(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ServerReady", request, grpc_context)

    async def ServerMetadata(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ServerMetadata", request, grpc_context)

    async def ModelReady(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ModelReady", request, grpc_context)

    async def ModelMetadata(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ModelMetadata", request, grpc_context)

    async def ModelInfer(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ModelInfer", request, grpc_context)

    async def ModelConfig(self, request: bytes, grpc_context: Any) -> Any:
        return await self._rpc("ModelConfig", request, grpc_context)

    async def ModelStreamInfer(self, requests: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """The bidirectional stream (Ray's gRPC proxy hands its requests over as they come), answered
        as neuropod serve answers it (see :mod:`~neuropod_serving.ray.streaming`)."""
        try:
            if self._expected_auth is not None:
                authenticate(grpc_context, self._expected_auth)
        except Exception as e:  # noqa: BLE001 - a refusal becomes the call's status
            code, details = status_of(e, "ModelStreamInfer", "?")
            grpc_context.set_code(code)
            grpc_context.set_details(details)
            return
        async for answer in model_stream_infer(self._servicer, requests, grpc_context):
            yield _Serialized(answer)

    async def ModelStatistics(self, request: bytes, grpc_context: Any) -> Any:
        # Answers UNIMPLEMENTED: a replica keeps no statistics (RayMetrics), and does not list them.
        return await self._rpc("ModelStatistics", request, grpc_context)


def _parse(spec: Any, data: bytes) -> Any:
    """A request's bytes as ``spec``'s request; a message that is not one is INVALID_ARGUMENT."""

    try:
        return spec.parse(data)
    except DecodeError as e:
        raise ProtocolError(f"the request is not a valid {spec.request.__name__} message: {e}") from None
