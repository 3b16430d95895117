"""Neuropod packages as Ray Serve applications: ``neuropod serve``, scaled across a cluster.

Each replica loads one package with :func:`neuropod.load_neuropod` and serves
it with the pieces ``neuropod serve`` is made of: the same
:class:`~neuropod_serving.server.Engine` (spec checks, batching, threads),
the same REST app (through Ray Serve's HTTP proxy) and the same gRPC
servicer (through Ray Serve's gRPC proxy). Clients (tritonclient, a remote
model loaded by URL) cannot tell which of the two answers.

Ray does the rest: placing replicas on nodes, autoscaling, restarting a
replica that died, routing. ::

    serve run neuropod_serving.ray:app package=/models/adder.neuropod max_batch_size=16

or, in Python::

    from ray import serve
    from neuropod_serving import ray as neuropod_ray

    neuropod_ray.start(http_port=8000, grpc_port=9000)
    serve.run(neuropod_ray.build("adder.neuropod", num_replicas=2), name="adder", route_prefix="/")

Packages reach replicas through Ray's object store, not a shared file system:
:func:`build` reads the package once, on the machine it runs on, and hands it
to a small detached actor (:class:`PackageStore`) that keeps it in the object
store for as long as the cluster runs; a replica on any node fetches it from
there, checks its sha256, and loads it from a copy in its node's package cache.

Needs ``pip install 'neuropod-serving[ray]'``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuropod.errors import NeuropodError, PackageError, PluginNotInstalledError

try:
    import ray
    from ray import serve
except ImportError as e:  # pragma: no cover - the extra is missing
    raise PluginNotInstalledError(
        f"neuropod_serving.ray needs Ray Serve ({e.name or 'ray'} is not installed): "
        "pip install 'neuropod-serving[ray]'"
    ) from None

log = logging.getLogger("neuropod_serving.ray")

#: What goes in ``grpc_options.grpc_servicer_functions`` (Serve config YAML or :class:`ray.serve.config.gRPCOptions`)
#: so that Ray Serve's gRPC proxy speaks the Open Inference Protocol's ``inference.GRPCInferenceService``.
GRPC_SERVICER = "neuropod_serving.ray.add_inference_servicer"
#: The detached actor holding packages, in its own namespace so every job of the cluster finds it.
STORE_NAME = "neuropod_package_store"
STORE_NAMESPACE = "neuropod"
#: The name of the deployment in every application :func:`build` makes.
DEPLOYMENT_NAME = "NeuropodModel"
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


# -- packages through the object store ---------------------------------------------------------------------


@dataclass(frozen=True)
class PackageRef:
    """A package published to the cluster: what a replica needs to fetch it."""

    #: sha256 of the package's zip, as published.
    digest: str
    #: The model's name (from the package's config).
    name: str
    size: int
    #: Where it was read from (for messages only: replicas never open it).
    source: str
    #: What the package asks of a device (see :func:`neuropod.resolve.gpu_preference`).
    prefers_gpu: bool = False
    requires_gpu: bool = False


@ray.remote(num_cpus=0, max_restarts=0)
class PackageStore:
    """Keeps published packages in Ray's object store, one object per distinct package.

    It owns the objects (an object lives as long as its owner), so a package
    outlives the driver or task that published it: a replica Ray starts an
    hour later, on a node that joined since, still finds it.
    """

    def __init__(self) -> None:
        self._objects: dict[str, list[Any]] = {}

    def has(self, digest: str) -> bool:
        return digest in self._objects

    def put(self, digest: str, data: bytes) -> None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise PackageError(f"a package sent to the store has sha256 {actual}, not the {digest} it was sent as")
        if digest not in self._objects:
            # A list: handing back [ref] lets the caller fetch it, rather than Ray resolving it here.
            self._objects[digest] = [ray.put(data)]

    def get(self, digest: str) -> list[Any] | None:
        return self._objects.get(digest)

    def forget(self, digest: str) -> bool:
        return self._objects.pop(digest, None) is not None

    def digests(self) -> list[str]:
        return sorted(self._objects)


def _store(create: bool) -> Any:
    """The cluster's package store (started on this node when ``create`` and there is none)."""
    if create:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        return PackageStore.options(  # type: ignore[attr-defined]
            name=STORE_NAME,
            namespace=STORE_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            # Beside the publisher, so the package is not copied across the network twice.
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        ).remote()
    try:
        return ray.get_actor(STORE_NAME, namespace=STORE_NAMESPACE)
    except ValueError:
        raise PackageError(
            f"this Ray cluster has no Neuropod package store (actor {STORE_NAME!r} in namespace "
            f"{STORE_NAMESPACE!r}): it was stopped, or its node died; deploy the application again"
        ) from None


def package_bytes(path: str | os.PathLike[str]) -> bytes:
    """The package at ``path`` as zip bytes: a zip read as it is, a directory zipped
    (stored, deterministically: :func:`neuropod.package.write_zip`).

    :raises PackageError: ``path`` is not a package.
    """
    import tempfile

    from neuropod.package import write_zip
    from neuropod_serving.server import is_package

    p = Path(path)
    if not p.exists():
        raise PackageError(f"{p}: no such file or directory")
    if not is_package(p):
        raise PackageError(f"{p} is not a Neuropod package: neither a directory nor a zip with a config.json")
    if p.is_file():
        return p.read_bytes()
    with tempfile.TemporaryDirectory(prefix="neuropod-ray-") as tmp:
        dest = Path(tmp, "package.zip")
        write_zip(p, dest, compression=zipfile.ZIP_STORED)
        return dest.read_bytes()


def _config(data: bytes, source: str) -> Any:
    """The package config in zip ``data`` (at its top, or under its single top folder)."""
    import json

    from neuropod.package import parse_config

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        tops = {n.split("/", 1)[0] for n in names}
        member = "config.json" if "config.json" in names else f"{tops.pop()}/config.json"
        try:
            return parse_config(json.loads(zf.read(member)), f"{source}: config.json")
        except (ValueError, KeyError) as e:
            raise PackageError(f"{source}: config.json cannot be read ({e})") from None


def publish(path: str | os.PathLike[str]) -> PackageRef:
    """Read the package at ``path`` once and put it in the cluster's package store (once per
    distinct package: publishing the same bytes again sends nothing).

    Connects to Ray (``ray.init()``) when this process is not connected yet. The package's
    files are checked against its manifest where it loads, in each replica.

    :raises PackageError: ``path`` is not a package, or its config cannot be read.
    """
    from neuropod.resolve import gpu_preference

    data = package_bytes(path)
    config = _config(data, str(path))
    prefers, requires = gpu_preference(config)
    digest = hashlib.sha256(data).hexdigest()
    store = _store(create=True)
    if not ray.get(store.has.remote(digest)):
        ray.get(store.put.remote(digest, data))
        log.info("published package %r (%s, %d bytes) to the cluster's object store", config.name, path, len(data))
    return PackageRef(digest, config.name, len(data), str(path), prefers_gpu=prefers, requires_gpu=requires)


def forget(package: PackageRef | str) -> bool:
    """Drop a published package (a :class:`PackageRef` or its digest) from the store; True when it was there.
    Replicas that already loaded it keep running; one Ray starts later cannot load it."""
    digest = package if isinstance(package, str) else package.digest
    return bool(ray.get(_store(create=False).forget.remote(digest)))


async def fetch(package: PackageRef) -> Path:
    """The package as a zip file on this node: from the node's package cache, else fetched from the store.

    :raises PackageError: the store does not hold it (any more), or what came is not what was published.
    """
    from neuropod.cache import cache_dir

    folder = cache_dir() / "ray"
    path = folder / f"{package.digest}.neuropod"
    if path.is_file() and path.stat().st_size == package.size:
        return path
    store = _store(create=False)
    holder = await store.get.remote(package.digest)
    if holder is None:
        raise PackageError(
            f"the cluster's package store no longer holds package {package.name!r} (sha256 {package.digest}, "
            f"published from {package.source}); deploy the application again"
        )
    data = await holder[0]
    actual = hashlib.sha256(data).hexdigest()
    if actual != package.digest:
        raise PackageError(f"package {package.name!r} arrived with sha256 {actual}, not the {package.digest} published")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{package.digest}.{os.getpid()}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -- per-replica metrics -------------------------------------------------------------------------------------


class RayMetrics:
    """``neuropod serve``'s metrics (same names, same buckets) recorded through Ray's metrics,
    tagged with the replica: each node's metrics agent exports them to Prometheus.

    Ray prefixes application metrics with ``ray_`` when it exports them
    (``ray_neuropod_requests_total{model,protocol,replica,...}``).
    """

    #: What ``GET /metrics`` on a replica answers (with 404): one replica's numbers behind a
    #: load-balancing proxy would mislead a scraper.
    elsewhere = (
        "on Ray Serve, each replica's metrics are exported by its node's Ray metrics agent "
        "(ray_neuropod_* with a replica tag; ray start --metrics-export-port), not at /metrics"
    )

    def __init__(self, replica: str, application: str) -> None:
        from ray.util import metrics as m

        from neuropod_serving.server.metrics import BATCH_BUCKETS, LATENCY_BUCKETS

        common = ("model", "replica", "application")
        self._tags = {"replica": replica, "application": application}
        latency = list(LATENCY_BUCKETS)
        self._requests = m.Counter("neuropod_requests", "Inference requests received", (*common, "protocol"))
        self._failures = m.Counter(
            "neuropod_request_failures",
            "Inference requests that failed, by who caused it: client (bad request) or model",
            (*common, "protocol", "reason"),
        )
        self._request_duration = m.Histogram(
            "neuropod_request_duration_seconds",
            "Time from a request reaching the replica's handler to its reply being encoded",
            latency,
            (*common, "protocol"),
        )
        self._queue = m.Histogram(
            "neuropod_queue_duration_seconds",
            "Time a request waited for a batch or a free thread before its model ran",
            latency,
            common,
        )
        self._compute = m.Histogram(
            "neuropod_compute_duration_seconds", "Time of one model run (one per batch when batching)", latency, common
        )
        self._batch = m.Histogram(
            "neuropod_batch_size", "Rows along the batch dimension per model run", list(BATCH_BUCKETS), common
        )
        self._loaded = m.Gauge("neuropod_models_loaded", "Models loaded and ready", ("replica", "application"))
        self._by_model: dict[str, dict[str, str]] = {}

    def _model(self, model: str) -> dict[str, str]:
        tags = self._by_model.get(model)
        if tags is None:
            tags = self._by_model[model] = {**self._tags, "model": model}
        return tags

    def request(self, model: str, protocol: str, seconds: float, failure: str | None = None) -> None:
        tags = {**self._model(model), "protocol": protocol}
        self._requests.inc(1, tags)
        self._request_duration.observe(seconds, tags)
        if failure is not None:
            self._failures.inc(1, {**tags, "reason": failure})

    def queued(self, model: str, seconds: float) -> None:
        self._queue.observe(seconds, self._model(model))

    def ran(self, model: str, queued: float, seconds: float, prepared: float = 0.0) -> None:
        tags = self._model(model)
        self._queue.observe(queued, tags)
        self._compute.observe(seconds, tags)

    def computed(
        self,
        model: str,
        seconds: float,
        rows: int | None,
        requests: int = 1,
        prepared: float = 0.0,
        extracted: float = 0.0,
        waited: Sequence[float] = (),
    ) -> None:
        # Triton's statistics (the other arguments) are not kept on Ray Serve: one replica's
        # numbers behind a load-balancing proxy would mislead, as /metrics would.
        tags = self._model(model)
        for w in waited:  # each request's wait in the queue, as queued() records one
            self._queue.observe(w, tags)
        self._compute.observe(seconds, tags)
        if rows is not None:
            self._batch.observe(rows, tags)

    def loaded(self, count: int) -> None:
        self._loaded.set(count, self._tags)


# -- the deployment ------------------------------------------------------------------------------------------


class _TooLarge(Exception):
    """A gRPC request over ``max_request_bytes`` (RESOURCE_EXHAUSTED)."""


class _Serialized:
    """Bytes the servicer already serialized, in the form Ray's replica sends gRPC answers."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


def _absolute_paths(app: Any) -> Any:
    """``app`` seeing every path whole: Ray sets ``root_path`` to the application's route
    prefix, and the Open Inference Protocol's routes are absolute (``/v2/models/...``)."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("root_path"):
            scope = {**scope, "root_path": ""}
        await app(scope, receive, send)

    return asgi


@serve.ingress()
class NeuropodModel:
    """One replica: one package, loaded once, served over REST (``neuropod serve``'s app) and
    gRPC (its servicer's methods, named as the protocol's RPCs for Ray's gRPC proxy)."""

    async def __init__(self, package: PackageRef, options: Mapping[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        from neuropod import load_neuropod
        from neuropod_serving.server import BatchPolicy, Engine, ModelRegistry, ServedModel
        from neuropod_serving.server.grpc_service import Servicer

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
            metrics = RayMetrics(self._replica, context.app_name)
            self._engine = Engine(registry, batching=batching, metrics=metrics)
        except BaseException:
            model.close()
            raise
        self._servicer = Servicer(self._engine)
        self._max_request_bytes = int(self._options.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES))
        token = self._options.get("auth_token")
        self._expected_auth = None if not token else f"Bearer {token}".encode()
        log.info(
            "replica %s serves %r (%s on %s) from %s",
            self._replica, model.name, model.backend.id, model.device, package.source,
        )  # fmt: skip

    def __serve_build_asgi_app__(self) -> Any:
        from neuropod_serving.server import create_app

        app = create_app(
            self._engine,
            auth_token=self._options.get("auth_token") or None,
            max_request_bytes=self._max_request_bytes,
        )
        return _absolute_paths(app)

    def info(self) -> dict[str, Any]:
        """Where this replica runs and what it serves (for operators and tests)."""
        (served,) = list(self._engine.registry)
        model = served.model
        runtime = ray.get_runtime_context()
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
        }

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    # The Open Inference Protocol's RPCs, by their names: Ray's gRPC proxy calls the method named as the RPC,
    # with the request's bytes (add_inference_servicer registers no parser) and the call's context.

    async def _rpc(self, method: str, data: bytes, grpc_context: Any) -> Any:
        import grpc

        from neuropod_serving.server.grpc_service import METHODS, authenticate, status_of

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

    async def ModelStatistics(self, request: bytes, grpc_context: Any) -> Any:
        # Answers UNIMPLEMENTED: a replica keeps no statistics (RayMetrics), and does not list them.
        return await self._rpc("ModelStatistics", request, grpc_context)


def _parse(spec: Any, data: bytes) -> Any:
    """A request's bytes as ``spec``'s request; a message that is not one is INVALID_ARGUMENT."""
    from google.protobuf.message import DecodeError

    from neuropod_serving.protocol import ProtocolError

    try:
        return spec.parse(data)
    except DecodeError as e:
        raise ProtocolError(f"the request is not a valid {spec.request.__name__} message: {e}") from None


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Register ``inference.GRPCInferenceService`` on Ray Serve's gRPC proxy (:data:`GRPC_SERVICER`).

    The proxy replaces each method's behaviour with a call to the deployment
    method of the same name; it keeps the (absent) request parser, so requests
    reach replicas as their bytes and are parsed there, by the same code as
    ``neuropod serve``'s.
    """
    import grpc

    from neuropod_serving.server.grpc_service import METHODS, SERVICE

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name, None) or _unbound(name)) for name in METHODS
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _unbound(name: str) -> Any:
    def rpc(request: Any, context: Any) -> Any:
        raise NotImplementedError(f"{name} is answered by Ray Serve's proxy")

    return rpc


# -- building applications -----------------------------------------------------------------------------------


def build(
    package: str | os.PathLike[str] | PackageRef,
    *,
    name: str | None = None,
    workers: int = 1,
    max_batch_size: int = 1,
    max_queue_delay_us: int = 0,
    num_replicas: int | str | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    auth_token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    load_options: Mapping[str, Any] | None = None,
) -> Any:
    """A Ray Serve application serving one package (publishes it to the cluster first; see :func:`publish`).

    :param name: the deployment's name (default ``NeuropodModel``); the model keeps the package's name.
    :param workers: above 1, each replica runs the model in that many out-of-process workers and
        reserves that many CPUs (``num_cpus``).
    :param max_batch_size: above 1, batch requests inside each replica (models whose spec has a
        batch dimension), as ``neuropod serve --max-batch-size``.
    :param max_queue_delay_us: as ``neuropod serve --max-queue-delay-us``.
    :param num_replicas: replicas (default 1; ``"auto"`` autoscales with Serve's defaults).
    :param autoscaling_config: Serve's autoscaling (``min_replicas``, ``max_replicas``,
        ``target_ongoing_requests``...); replaces ``num_replicas``.
    :param ray_actor_options: overrides what placement derives from the package: ``num_gpus: 1`` when
        it needs a GPU (or prefers one and the cluster has GPUs), ``num_cpus: workers``.
    :param max_ongoing_requests: requests a replica takes at once (default: enough to fill batches).
    :param auth_token: require ``Authorization: Bearer <token>`` (gRPC: ``authorization`` metadata)
        on everything but the health routes, as ``neuropod serve --auth-token-file``.
    :param load_options: more keyword arguments for :func:`neuropod.load_neuropod` in each replica.
    :raises PackageError: the package cannot be read.
    :raises ValueError: an option is out of range.
    """
    for label, value, low in (("workers", workers, 1), ("max_batch_size", max_batch_size, 1),
                              ("max_request_bytes", max_request_bytes, 1), ("max_queue_delay_us", max_queue_delay_us, 0)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{label} must be a whole number of at least {low}, not {value!r}")
    if max_queue_delay_us > 10_000_000:
        raise ValueError(f"max_queue_delay_us must be at most 10,000,000 (10 s), not {max_queue_delay_us}")
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token is empty: pass None to serve without authentication")
    ref = package if isinstance(package, PackageRef) else publish(package)
    actor_options = dict(ray_actor_options or {})
    if "num_gpus" not in actor_options and _wants_gpu(ref):
        actor_options["num_gpus"] = 1
    actor_options.setdefault("num_cpus", workers)
    options: dict[str, Any] = {
        "workers": workers,
        "max_batch_size": max_batch_size,
        "max_queue_delay_us": max_queue_delay_us,
        "auth_token": auth_token,
        "max_request_bytes": max_request_bytes,
        "load_options": dict(load_options or {}),
        "gpu": bool(actor_options.get("num_gpus")),
    }
    deployment_options: dict[str, Any] = {"name": name or DEPLOYMENT_NAME, "ray_actor_options": actor_options}
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = dict(autoscaling_config)
    elif num_replicas is not None:
        deployment_options["num_replicas"] = num_replicas
    # Enough requests in a replica for batches to fill and OPE workers to stay busy.
    deployment_options["max_ongoing_requests"] = max_ongoing_requests or max(8, 2 * workers * max_batch_size)
    deployment = serve.deployment(NeuropodModel).options(**deployment_options)
    return deployment.bind(ref, options)


def _wants_gpu(package: PackageRef) -> bool:
    """Whether a replica should reserve a GPU: the package needs one, or prefers one and the cluster has one."""
    if package.requires_gpu:
        return True
    return package.prefers_gpu and ray.cluster_resources().get("GPU", 0) > 0


#: build()'s keywords that ``serve run ... key=value`` may give, and how each is read.
_ARGS: dict[str, Any] = {
    "name": str,
    "workers": int,
    "max_batch_size": int,
    "max_queue_delay_us": int,
    "num_replicas": lambda v: v if str(v) == "auto" else int(v),
    "max_ongoing_requests": int,
    "auth_token": str,
    "max_request_bytes": int,
    "num_cpus": float,
    "num_gpus": float,
    "min_replicas": int,
    "max_replicas": int,
    "target_ongoing_requests": float,
}
_AUTOSCALING = ("min_replicas", "max_replicas", "target_ongoing_requests")


def app(args: Mapping[str, Any]) -> Any:
    """The application builder of ``serve run neuropod_serving.ray:app package=PATH [key=value...]``
    and of a Serve config's ``import_path: neuropod_serving.ray:app`` (its ``args``).

    Keys: ``package`` (required), :func:`build`'s ``name``, ``workers``, ``max_batch_size``,
    ``max_queue_delay_us``, ``num_replicas``, ``max_ongoing_requests``, ``auth_token``,
    ``max_request_bytes``; ``num_cpus``/``num_gpus`` (into ``ray_actor_options``);
    ``min_replicas``/``max_replicas``/``target_ongoing_requests`` (into ``autoscaling_config``).
    A config's ``deployments:`` section can set Serve's own options (replicas, autoscaling,
    ``ray_actor_options``) on the deployment ``NeuropodModel`` instead.

    :raises NeuropodError: ``package`` is missing, a key is unknown, or a value does not parse.
    """
    args = dict(args)
    package = args.pop("package", None)
    if not package:
        raise NeuropodError("neuropod_serving.ray:app needs package=PATH (a package directory or zip)")
    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise NeuropodError(
            f"neuropod_serving.ray:app does not take {', '.join(unknown)}; it takes package and "
            f"{', '.join(sorted(_ARGS))}"
        )
    values: dict[str, Any] = {}
    for key, value in args.items():
        try:
            values[key] = _ARGS[key](value)
        except (TypeError, ValueError):
            raise NeuropodError(f"neuropod_serving.ray:app: {key}={value!r} is not a valid {key}") from None
    actor: dict[str, Any] = {k: values.pop(k) for k in ("num_cpus", "num_gpus") if k in values}
    scaling: dict[str, Any] = {k: values.pop(k) for k in _AUTOSCALING if k in values}
    try:
        return build(
            package,
            ray_actor_options=actor or None,
            autoscaling_config=scaling or None,
            **values,
        )
    except ValueError as e:
        raise NeuropodError(f"neuropod_serving.ray:app: {e}") from None


def start(
    *,
    http_host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 9000,
    proxy_location: str | None = None,
) -> None:
    """Start Ray Serve on the connected cluster (``ray.init`` first, or it starts a local one) with its
    HTTP proxy on ``http_host:http_port`` and its gRPC proxy on ``grpc_port`` speaking the
    Open Inference Protocol (``grpc_port=0``: no gRPC).

    :param proxy_location: Serve's ``"EveryNode"`` (its default), ``"HeadOnly"`` or ``"Disabled"``.
    """
    from ray.serve.config import gRPCOptions

    kwargs: dict[str, Any] = {"http_options": {"host": http_host, "port": http_port}}
    if grpc_port:
        kwargs["grpc_options"] = gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER])
    if proxy_location is not None:
        kwargs["proxy_location"] = proxy_location
    serve.start(**kwargs)


__all__ = [
    "DEPLOYMENT_NAME",
    "GRPC_SERVICER",
    "NeuropodModel",
    "PackageRef",
    "PackageStore",
    "RayMetrics",
    "add_inference_servicer",
    "app",
    "build",
    "fetch",
    "forget",
    "package_bytes",
    "publish",
    "start",
]
