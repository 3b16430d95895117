"""Packages through Ray's object store: published once by the driver, fetched by each replica."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuropod.cache import cache_dir
from neuropod.errors import PackageError
from neuropod.package import parse_config, write_zip
from neuropod.resolve import gpu_preference
from neuropod_serving.ray._extra import ray
from neuropod_serving.server.registry import is_package

log = logging.getLogger("neuropod_serving.ray")

#: The detached actor holding packages, in its own namespace so every job of the cluster finds it.
STORE_NAME = "neuropod_package_store"
STORE_NAMESPACE = "neuropod"


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
    #: The package declares state or sequence controls (its sequences need routing: see
    #: :mod:`~neuropod_serving.ray.sequence_router`).
    stateful: bool = False


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


def _configs(data: bytes, source: str) -> list[Any]:
    """The package config in zip ``data`` (at its top, or under its single top folder), then, for a
    pipeline, the config of each step packaged inside it (a step on a server has none here)."""

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        tops = {n.split("/", 1)[0] for n in names}
        prefix = "" if "config.json" in names else f"{tops.pop()}/"
        members = [f"{prefix}config.json"]
        configs: list[Any] = []
        while members:
            member = members.pop(0)
            inside = member.removeprefix(prefix)
            try:
                config = parse_config(json.loads(zf.read(member)), f"{source}: {inside}")
            except (ValueError, KeyError) as e:
                raise PackageError(f"{source}: {inside} cannot be read ({e})") from None
            configs.append(config)
            if config.pipeline is not None and len(configs) == 1:
                members += [f"{prefix}{s.package}/config.json" for s in config.pipeline.steps if s.package]
        return configs


def publish(path: str | os.PathLike[str]) -> PackageRef:
    """Read the package at ``path`` once and put it in the cluster's package store (once per
    distinct package: publishing the same bytes again sends nothing).

    Connects to Ray (``ray.init()``) when this process is not connected yet. The package's
    files are checked against its manifest where it loads, in each replica.

    :raises PackageError: ``path`` is not a package, or its config cannot be read.
    """

    data = package_bytes(path)
    # A pipeline's placement and routing come from its steps: a replica runs them all.
    configs = _configs(data, str(path))
    config = configs[0]
    preferences = [gpu_preference(c) for c in configs]
    prefers, requires = any(p for p, _ in preferences), any(r for _, r in preferences)
    digest = hashlib.sha256(data).hexdigest()
    store = _store(create=True)
    if not ray.get(store.has.remote(digest)):
        ray.get(store.put.remote(digest, data))
        log.info("published package %r (%s, %d bytes) to the cluster's object store", config.name, path, len(data))
    stateful = any(c.state_spec or c.sequence_controls for c in configs)
    return PackageRef(digest, config.name, len(data), str(path), prefers_gpu=prefers, requires_gpu=requires,
                      stateful=stateful)  # fmt: skip


def forget(package: PackageRef | str) -> bool:
    """Drop a published package (a :class:`PackageRef` or its digest) from the store; True when it was there.
    Replicas that already loaded it keep running; one Ray starts later cannot load it."""
    digest = package if isinstance(package, str) else package.digest
    return bool(ray.get(_store(create=False).forget.remote(digest)))


async def fetch(package: PackageRef) -> Path:
    """The package as a zip file on this node: from the node's package cache, else fetched from the store.

    :raises PackageError: the store does not hold it (any more), or what came is not what was published.
    """

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
