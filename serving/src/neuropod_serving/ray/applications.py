"""Ray Serve applications of packages: :func:`build` in Python, :func:`app` for ``serve run`` and
Serve configs, and :func:`start` to start Serve with the Open Inference Protocol's gRPC service."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from neuropod.errors import NeuropodError
from neuropod_serving.defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_SEQUENCE_IDLE_US, DEFAULT_MAX_SEQUENCES
from neuropod_serving.ray._extra import ray, serve
from neuropod_serving.ray.deployment import DEPLOYMENT_NAME, NeuropodDeployment
from neuropod_serving.ray.grpc_servicer import GRPC_SERVICER
from neuropod_serving.ray.packages import PackageRef, publish

#: The request router of a stateful package's deployment (imported by Ray Serve where it routes).
SEQUENCE_ROUTER = "neuropod_serving.ray.sequence_router.SequenceRouter"


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
    max_sequence_idle_us: int = DEFAULT_MAX_SEQUENCE_IDLE_US,
    max_sequences: int = DEFAULT_MAX_SEQUENCES,
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
    :param max_sequence_idle_us: a stateful model's sequence idle this long is freed, as ``neuropod
        serve --max-sequence-idle-us`` (Triton's default, 1 s).
    :param max_sequences: a stateful model's live sequences in each replica, as ``neuropod serve
        --max-sequences``.
    :raises PackageError: the package cannot be read.
    :raises ValueError: an option is out of range.
    """
    for label, value, low in (("workers", workers, 1), ("max_batch_size", max_batch_size, 1),
                              ("max_request_bytes", max_request_bytes, 1), ("max_queue_delay_us", max_queue_delay_us, 0),
                              ("max_sequence_idle_us", max_sequence_idle_us, 1), ("max_sequences", max_sequences, 1)):  # fmt: skip
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
        "max_sequence_idle_us": max_sequence_idle_us,
        "max_sequences": max_sequences,
    }
    deployment_options: dict[str, Any] = {"name": name or DEPLOYMENT_NAME, "ray_actor_options": actor_options}
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = dict(autoscaling_config)
    elif num_replicas is not None:
        deployment_options["num_replicas"] = num_replicas
    # Enough requests in a replica for batches to fill and OPE workers to stay busy.
    deployment_options["max_ongoing_requests"] = max_ongoing_requests or max(8, 2 * workers * max_batch_size)
    if ref.stateful or (load_options or {}).get("sequences"):
        # A sequence's steps go to the replica that holds its state (see sequence_router).
        deployment_options["request_router_config"] = {"request_router_class": SEQUENCE_ROUTER}
        options["stateful"] = True
    deployment = serve.deployment(NeuropodDeployment).options(**deployment_options)
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
    "max_sequence_idle_us": int,
    "max_sequences": int,
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
    ``max_request_bytes``, ``max_sequence_idle_us``, ``max_sequences``; ``num_cpus``/``num_gpus`` (into ``ray_actor_options``);
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
