"""A simulated two-node cluster (``ray.cluster_utils.Cluster``): the replica runs on the node that
does not hold the package file, and the file is deleted before Serve starts it, so the package can
only reach the replica through Ray's object store.

Each node has its own package cache (``NEUROPOD_CACHE_DIR`` in the node's environment), as two
machines would. Runs its own cluster: in a pytest process of its own, or after shutting down
another module's.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("onnxruntime")

import ray
from ray import serve
from ray.cluster_utils import Cluster

import neuropod
from neuropod_serving import ray as neuropod_ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_support import adder_inputs, adder_package, check_adder, http, replica_infos, rest_body, rest_outputs

from conftest import free_port_below_ephemeral, private_caches


@dataclass
class TwoNodes:
    root: Path
    head_id: str
    far_id: str
    http_port: int
    grpc_port: int


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    """A head node (1 CPU, its own cache) and a second node (1 CPU, resource "far", its own cache);
    Serve with one proxy, on the head (two proxies on one machine would want the same ports)."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-ray-nodes-"))
    if ray.is_initialized():  # another module's cluster in this process
        serve.shutdown()
        ray.shutdown()
    with private_caches(root):  # the driver's own cache
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False,
                            "env_vars": {"NEUROPOD_CACHE_DIR": str(root / "head-cache")}},
        )  # fmt: skip
        try:
            far = cluster.add_node(
                num_cpus=1, resources={"far": 1}, env_vars={"NEUROPOD_CACHE_DIR": str(root / "far-cache")}
            )
            ray.init(address=cluster.address)
            cluster.wait_for_nodes()
            nodes = TwoNodes(root, ray.get_runtime_context().get_node_id(), far.node_id, free_port_below_ephemeral(), free_port_below_ephemeral())
            assert nodes.head_id != nodes.far_id
            neuropod_ray.start(http_port=nodes.http_port, grpc_port=nodes.grpc_port, proxy_location="HeadOnly")
            yield nodes
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(root, ignore_errors=True)


def test_a_replica_on_the_node_without_the_file_loads_the_package_from_the_object_store(two_nodes: TwoNodes) -> None:
    models = two_nodes.root / "models"
    package = adder_package(models / "adder.neuropod")
    digest = hashlib.sha256(package.read_bytes()).hexdigest()
    app = neuropod_ray.build(package, ray_actor_options={"num_cpus": 0.5, "resources": {"far": 1}})
    shutil.rmtree(models)  # build() has read it: nothing on disk is needed from here on
    serve.run(app, name="adder", route_prefix="/")

    (info,) = replica_infos("adder", 1).values()
    assert info["node_id"] == two_nodes.far_id, (info, two_nodes)
    # The replica loaded a copy in the far node's own cache, with the bytes of the deleted file.
    copy = Path(info["package_path"])
    assert copy.parent == two_nodes.root / "far-cache" / "ray", info
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest
    assert not (two_nodes.root / "head-cache" / "ray").exists()
    assert not package.exists()

    # Served through the head node's proxies: our remote client by gRPC and REST, and a plain POST.
    rng = np.random.default_rng(0)
    for url in (f"grpc://127.0.0.1:{two_nodes.grpc_port}/adder", f"http://127.0.0.1:{two_nodes.http_port}/adder"):
        with neuropod.load_neuropod(url) as model:
            for rows in (1, 3):
                inputs = adder_inputs(rng, rows)
                check_adder(inputs, model.infer(inputs))
    inputs = adder_inputs(rng, 2)
    status, body = http(f"http://127.0.0.1:{two_nodes.http_port}/v2/models/adder/infer", rest_body(inputs))
    assert status == 200, body
    check_adder(inputs, rest_outputs(body))
