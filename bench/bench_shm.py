"""Tensors in system shared memory against tensors in the message, for a 6.9 MB image input.

    python bench/bench_shm.py [--calls 40]

One ONNX model, ``image`` float32 [1, 3, 1080, 533] (6.9 MB) -> ``mean`` float32
[1, 3] (ReduceMean: the model's own run is small next to moving the image), served
by ``neuropod serve --allow-client-shm`` in a process of its own and called with
tritonclient, as a Triton user would:

- the model's own run: onnxruntime directly, in this process;
- binary tensors in the message, over REST (Triton's binary extension) and gRPC;
- system shared memory over REST and gRPC: the image in a region the client wrote
  once, the output written by the server into another region and read back with
  ``get_contents_as_numpy`` (both timed).

Each line is the median of per-call latencies, and the overhead is that median
minus the model's own median. The machine's other load moves these figures: read
them as medians of one run, compared within it. The server reads each input out of
its region with ``pread`` on the region's descriptor into a fresh array (the model
gets an array of its own, which a client cannot change under it, and a client that
shrinks its object cannot fault the server, as it could through a mapping). The last
line times that read alone, in this process through the server's own registry, beside
a memory-to-memory copy of the same bytes (what reading through a mapping would cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SHAPE = (1, 3, 1080, 533)


def _package(dest: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    from neuropod.packagers import create_onnx_neuropod

    node = helper.make_node("ReduceMean", ["image", "axes"], ["mean"], keepdims=0)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("mean", TensorProto.FLOAT, [1, 3])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    # The floor: the same call with a 12-byte input, to a model that does as little.
    tiny = helper.make_graph(
        [helper.make_node("ReduceMean", ["image", "axes"], ["mean"], keepdims=0)], "t",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 1, 1])],
        [helper.make_tensor_value_info("mean", TensorProto.FLOAT, [1, 3])],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])],
    )  # fmt: skip
    tiny_model = helper.make_model(tiny, opset_imports=[helper.make_opsetid("", 18)])
    tiny_model.ir_version = 8
    create_onnx_neuropod(
        dest / "tiny_mean", "tiny_mean", onnx_model=tiny_model,
        input_spec=[{"name": "image", "dtype": "float32", "shape": [1, 3, 1, 1]}],
        output_spec=[{"name": "mean", "dtype": "float32", "shape": [1, 3]}],
    )  # fmt: skip
    return Path(create_onnx_neuropod(
        dest / "image_mean", "image_mean", onnx_model=model,
        input_spec=[{"name": "image", "dtype": "float32", "shape": list(SHAPE)}],
        output_spec=[{"name": "mean", "dtype": "float32", "shape": [1, 3]}],
    ))  # fmt: skip


def _median_ms(fn: Callable[[], Any], calls: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _server_read_ms(key: str, size: int, calls: int) -> float:
    """The median time of the server's read of ``size`` bytes of the object ``key`` as one input."""
    from neuropod_serving.protocol.shm_params import SharedMemoryRequest, SharedTensor
    from neuropod_serving.server.shm_regions import SharedMemoryRegistry

    registry = SharedMemoryRegistry()
    try:
        registry.register_system("bench_read", key, 0, size)
        request = SharedMemoryRequest(inputs={"image": SharedTensor("image", "bench_read", 0, size, "FP32", SHAPE)})

        def read() -> Any:
            lease = registry.lease(request)
            try:
                return lease.read_inputs()
            finally:
                lease.release()

        return _median_ms(read, calls)
    finally:
        registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per line (default 40)")
    args = parser.parse_args()

    import onnxruntime as ort
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
    import tritonclient.utils.shared_memory as shm

    from neuropod.testing import served

    image = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    expected = image.mean(axis=(2, 3))
    tiny = image[:, :, :1, :1].copy()
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="neuropod-bench-shm-") as tmp:
        root = Path(tmp)
        package = _package(root / "models")
        model_file = next(package.glob("0/data/*.onnx"))
        session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
        own = _median_ms(lambda: session.run(["mean"], {"image": image}), args.calls)
        rows.append(("model's own run (onnxruntime)", own))
        memcpy_ms = _median_ms(lambda: np.array(image, copy=True), args.calls)

        in_key, out_key = f"/neuropod-bench-in-{time.time_ns()}", f"/neuropod-bench-out-{time.time_ns()}"
        in_handle = shm.create_shared_memory_region("bench_in", in_key, image.nbytes)
        out_handle = shm.create_shared_memory_region("bench_out", out_key, 64)
        try:
            shm.set_shared_memory_region(in_handle, [image])
            read_ms = _server_read_ms(in_key, image.nbytes, args.calls)
            with served(root / "models", options=["--allow-client-shm"]) as where:
                clients = {
                    "REST": (thttp, thttp.InferenceServerClient(where.http.removeprefix("http://"))),
                    "gRPC": (tgrpc, tgrpc.InferenceServerClient(where.grpc)),
                }
                clients["REST"][1].register_system_shared_memory("bench_in", in_key, image.nbytes)
                clients["REST"][1].register_system_shared_memory("bench_out", out_key, 64)
                for label, (module, client) in clients.items():
                    binary = {"binary_data": True} if module is thttp else {}

                    def in_message(module: Any = module, client: Any = client, binary: Any = binary) -> np.ndarray:
                        tensor = module.InferInput("image", list(SHAPE), "FP32")
                        tensor.set_data_from_numpy(image, **binary)
                        result = client.infer(
                            "image_mean", [tensor], outputs=[module.InferRequestedOutput("mean", **binary)]
                        )
                        return result.as_numpy("mean")

                    def in_shm(module: Any = module, client: Any = client) -> np.ndarray:
                        tensor = module.InferInput("image", list(SHAPE), "FP32")
                        tensor.set_shared_memory("bench_in", image.nbytes)
                        output = module.InferRequestedOutput("mean")
                        output.set_shared_memory("bench_out", 64)
                        client.infer("image_mean", [tensor], outputs=[output])
                        return shm.get_contents_as_numpy(out_handle, np.float32, [1, 3])

                    def floor(module: Any = module, client: Any = client, binary: Any = binary) -> np.ndarray:
                        tensor = module.InferInput("image", [1, 3, 1, 1], "FP32")
                        tensor.set_data_from_numpy(tiny, **binary)
                        result = client.infer(
                            "tiny_mean", [tensor], outputs=[module.InferRequestedOutput("mean", **binary)]
                        )
                        return result.as_numpy("mean")

                    for fn in (in_message, in_shm):
                        np.testing.assert_allclose(fn(), expected, rtol=1e-4)
                    rows.append((f"{label}, 12-byte input to a tiny model (floor)", _median_ms(floor, args.calls)))
                    rows.append((f"{label}, binary tensors in the message", _median_ms(in_message, args.calls)))
                    rows.append((f"{label}, system shared memory", _median_ms(in_shm, args.calls)))
                clients["REST"][1].unregister_system_shared_memory()
                for _, client in clients.values():
                    client.close()
        finally:
            shm.destroy_shared_memory_region(in_handle)
            shm.destroy_shared_memory_region(out_handle)

    print(f"image float32 {list(SHAPE)} = {image.nbytes / 1e6:.1f} MB, output float32 [1, 3]; "
          f"medians of {args.calls} calls (one run on a shared machine: compare lines within it)")  # fmt: skip
    print(f"{'':<48}{'ms':>9}{'overhead ms':>14}")
    for name, ms in rows:
        print(f"{name:<48}{ms:9.2f}{ms - own:14.2f}")
    print(f"the server's read of the input out of its region (pread into a fresh array, {image.nbytes / 1e6:.1f} MB): "
          f"{read_ms:.2f} ms; a memory-to-memory copy of it: {memcpy_ms:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
