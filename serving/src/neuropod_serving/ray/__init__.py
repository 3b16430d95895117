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

A decoupled package streams its responses through the replica as it makes
them: REST ``infer_stream`` through Ray's HTTP proxy, gRPC ``ModelStreamInfer``
through its gRPC proxy, and the deployment's ``infer_stream`` generator method
for Ray's streaming handles (:mod:`neuropod_serving.ray.streaming`).

A stateful package (``state_spec`` or ``sequence_controls``) keeps each
sequence's state in one replica: its deployment's request router
(:class:`~neuropod_serving.ray.sequence_router.SequenceRouter`) sends every
step of a sequence there, and refuses a step whose replica is gone with a
:class:`~neuropod.errors.SequenceError` saying so.

Packages reach replicas through Ray's object store, not a shared file system:
:func:`build` reads the package once, on the machine it runs on, and hands it
to a small detached actor (:class:`PackageStore`) that keeps it in the object
store for as long as the cluster runs; a replica on any node fetches it from
there, checks its sha256, and loads it from a copy in its node's package cache.

Needs ``pip install 'neuropod-serving[ray]'``.
"""

from __future__ import annotations

from neuropod_serving.ray.applications import app, build, start
from neuropod_serving.ray.deployment import DEPLOYMENT_NAME, NeuropodDeployment
from neuropod_serving.ray.grpc_servicer import GRPC_SERVICER, add_inference_servicer
from neuropod_serving.ray.metrics import RayMetrics
from neuropod_serving.ray.packages import (
    STORE_NAME,
    STORE_NAMESPACE,
    PackageRef,
    PackageStore,
    fetch,
    forget,
    package_bytes,
    publish,
)

__all__ = [
    "DEPLOYMENT_NAME",
    "GRPC_SERVICER",
    "NeuropodDeployment",
    "PackageRef",
    "PackageStore",
    "STORE_NAME",
    "STORE_NAMESPACE",
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
