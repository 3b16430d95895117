"""Triton's own Python client examples, run unchanged against ``neuropod serve``.

    python bench/triton_examples.py --examples DIR [--timeout 60] [--only NAME ...] [--ensemble pipeline|config]
                                    [--verbose] [--json out.json]

DIR is a checkout of triton-inference-server/client (or its
``src/python/examples`` folder, or a clone without a work tree: its HEAD).
The example scripts are copied from there into a temporary folder at run
time; nothing of them is kept here.

The harness builds, as real Neuropod packages (ONNX graphs made with
``onnx.helper``), the models the examples call, with the names, tensor names,
data types, shapes and batching they expect:

* ``simple``: INT32 ``INPUT0``/``INPUT1`` [batch, 16] -> ``OUTPUT0`` = sum,
  ``OUTPUT1`` = difference; ``simple_int8`` the same in INT8;
* ``simple_string``: the same over BYTES tensors holding decimal integers;
* ``simple_identity`` (BYTES) and ``custom_identity_int32`` (INT32 [batch, -1]):
  ``OUTPUT0`` = ``INPUT0``;
* ``densenet_onnx``: FP32 ``data_0`` [3, 224, 224] (NCHW) -> ``fc6_1``
  [1000, 1, 1] with class labels, unbatched, as Triton's image example model
  (a small graph, not DenseNet: the examples check shapes and the protocol,
  not the classes);
* ``repeat_int32``: a decoupled Python-backend package with the interface of
  Triton's ``repeat`` example backend: INT32 ``IN`` [n], UINT32 ``DELAY`` [n]
  (microseconds before each response), UINT32 ``WAIT`` [1] (after the last)
  -> one response per element of ``IN``: ``OUT`` INT32 [1] (the element),
  ``IDX`` UINT32 [1] (its index);
* the sequence examples' stateful models, declared with the packaging keywords
  ``sequence_controls`` and ``state_spec``: ``simple_sequence`` (INT32
  ``INPUT``, controls ``START``, ``READY`` [batch, 1] -> ``OUTPUT`` =
  READY * (INPUT + START), as Triton's ONNX example model), ``simple_dyna_sequence``
  (adds ``END`` and UINT64 ``CORRID``: + END * CORRID) and
  ``simple_string_dyna_sequence`` (Triton's ``dyna_sequence`` test backend: an
  accumulator kept as implicit state, a STRING ``CORRID`` added on END);
* ``preprocess_inception_ensemble``, the model of ``ensemble_image_client.py``
  (``serving/tests/ensemble_models.py``): BYTES ``INPUT`` [batch, 1] (image
  files) -> FP32 ``OUTPUT`` [batch, 1001] with labels, a Pillow decoding step
  (Python backend) chained to a small ONNX classifier. ``--ensemble pipeline``
  (the default) serves it as one pipeline package; ``--ensemble config`` serves
  its two steps and loads it with Triton's ensemble configuration.

The sequence models and the ensemble are served by a second ``neuropod serve``
(``--max-batch-size 8``, free ports), as ``simple_http_model_control.py``
counts the first one's models.

It starts one ``neuropod serve`` over that repository (on 8000/8001 when they
are free, as ``memory_growth_test.py`` hard-codes them, else on free ports;
``--allow-client-shm``, ``--max-batch-size 8``) and the second server, loads ``densenet_onnx`` with
a configuration naming its input format (Triton reads that from the model's
``config.pbtxt``), runs every example as a subprocess of this interpreter,
one run per protocol variant (``-u host:port``, ``-i http|grpc`` where a
script takes them; the sequence examples plainly and with ``-d``, as Triton's QA
runs them), each with a timeout, and prints one line a run: PASS,
FAIL (with the last line of its output, and ``[expected: why]`` where the
example checks something only Triton itself has: its name, its test
repository) or SKIP (with the reason: a feature neuropod serve does not have,
or a GPU or cuda-python this machine lacks); then the totals, "N of M runs
pass". The servers are stopped and the temporary folder removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _servers import free_port, log_tail, stop_group, wait_ready

#: Why runs that fail are expected to: checks of Triton itself or of Triton's test repository.
TRITON_NAME = "checks that the server's name is 'triton'; neuropod serve's is 'neuropod'"
TRITON_REPO = "checks that the repository holds exactly {n} models, as Triton's test repository does"
NO_FILE_LOADS = ("; then expects INTERNAL 'failed to poll from model repository' for a load with a file: override, "
                 "which neuropod serve refuses as INVALID_ARGUMENT (packages come from its PATHs only)")  # fmt: skip

IMAGE_ARGS = ["-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION"]


@dataclass
class Run:
    script: str
    variant: str  # "http", "grpc" or "-"; "-d" added for a sequence example's dyna run
    # placeholders {http}, {grpc}, {seq_http}, {seq_grpc} (the second server), {image}
    args: list[str] = field(default_factory=list)
    skip: str = ""
    needs_gpu: bool = False
    needs_default_ports: bool = False
    known: str = ""  # why it is expected to fail
    status: str = ""
    detail: str = ""
    seconds: float = 0.0


def plan() -> list[Run]:
    """Every run, in the order they run (the model-control examples last: they unload ``simple``)."""
    runs = [
        Run("grpc_client.py", "grpc", ["-u", "{grpc}"]),
        Run("grpc_explicit_byte_content_client.py", "grpc", ["-u", "{grpc}"]),
        Run("grpc_explicit_int8_content_client.py", "grpc", ["-u", "{grpc}"]),
        Run("grpc_explicit_int_content_client.py", "grpc", ["-u", "{grpc}"]),
        Run("grpc_image_client.py", "grpc", [*IMAGE_ARGS, "-u", "{grpc}", "{image}"]),
        Run("image_client.py", "http", [*IMAGE_ARGS, "-i", "http", "-u", "{http}", "{image}"]),
        Run("image_client.py", "grpc", [*IMAGE_ARGS, "-i", "grpc", "-u", "{grpc}", "{image}"]),
        # preprocess_inception_ensemble is on the second server (see build_second_models).
        Run("ensemble_image_client.py", "http", ["-i", "http", "-u", "{seq_http}", "-c", "3", "{image}"]),
        Run("ensemble_image_client.py", "grpc", ["-i", "grpc", "-u", "{seq_grpc}", "-c", "3", "{image}"]),
        Run("memory_growth_test.py", "http", ["-i", "http"], needs_default_ports=True),
        Run("memory_growth_test.py", "grpc", ["-i", "grpc"], needs_default_ports=True),
        Run("reuse_infer_objects_client.py", "http", ["-i", "http", "-u", "{http}"]),
        Run("reuse_infer_objects_client.py", "grpc", ["-i", "grpc", "-u", "{grpc}"]),
    ]
    for name in ("aio_infer", "async_infer", "custom_args", "health_metadata", "infer", "keepalive",
                 "shm", "shm_string", "string_infer"):  # fmt: skip
        health = name == "health_metadata"
        runs.append(Run(f"simple_grpc_{name}_client.py" if not health else "simple_grpc_health_metadata.py", "grpc",
                        ["-u", "{grpc}"], known=TRITON_NAME if health else ""))  # fmt: skip
    runs.append(Run("simple_grpc_cudashm_client.py", "grpc", ["-u", "{grpc}"], needs_gpu=True))
    runs.append(Run("simple_grpc_custom_repeat.py", "grpc", ["-u", "{grpc}"]))
    for name in ("aio_sequence_stream", "sequence_stream", "sequence_sync"):
        runs.append(Run(f"simple_grpc_{name}_infer_client.py", "grpc", ["-u", "{seq_grpc}"]))
        runs.append(Run(f"simple_grpc_{name}_infer_client.py", "grpc-d", ["-u", "{seq_grpc}", "-d"]))
    for name in ("aio_infer", "async_infer", "health_metadata", "infer", "shm", "shm_string", "string_infer"):
        health = name == "health_metadata"
        runs.append(Run(f"simple_http_{name}_client.py" if not health else "simple_http_health_metadata.py", "http",
                        ["-u", "{http}"], known=TRITON_NAME if health else ""))  # fmt: skip
    runs.append(Run("simple_http_cudashm_client.py", "http", ["-u", "{http}"], needs_gpu=True))
    runs.append(Run("simple_http_sequence_sync_infer_client.py", "http", ["-u", "{seq_http}"]))
    runs.append(Run("simple_http_sequence_sync_infer_client.py", "http-d", ["-u", "{seq_http}", "-d"]))
    runs.append(Run("simple_grpc_model_control.py", "grpc", ["-u", "{grpc}"],
                    known=TRITON_REPO.format(n=8) + NO_FILE_LOADS))  # fmt: skip
    # The repository here holds seven models (build_models), the number this one checks for: it passes
    # as long as that stays so, and says why it fails otherwise.
    runs.append(Run("simple_http_model_control.py", "http", ["-u", "{http}"], known=TRITON_REPO.format(n=7)))
    return runs


# -- models ------------------------------------------------------------------------------------------------------------


def _onnx(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any] = ()) -> Any:  # type: ignore[assignment]
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], initializer=list(inits))  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _spec(entries: list[tuple[str, str, list[Any]]]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t, "shape": s} for n, t, s in entries]


#: ``repeat_int32``'s code: a generator, one response per element of ``IN`` (a decoupled model).
REPEAT_INT32 = """
import time

import numpy as np


def get_model(data_root):
    def repeat(IN, DELAY, WAIT):
        for i, value in enumerate(IN):
            time.sleep(int(DELAY[i]) / 1e6)
            yield {"OUT": np.array([value], np.int32), "IDX": np.array([i], np.uint32)}
        time.sleep(int(WAIT[0]) / 1e6)

    return repeat
"""


def build_repeat_int32(dest: Path) -> None:
    """``repeat_int32`` as a decoupled Python-backend package at ``dest`` (its code written in a temporary folder)."""
    from neuropod.packagers import create_python_neuropod

    with tempfile.TemporaryDirectory(prefix="repeat-int32-code-") as code:
        (Path(code) / "repeat_int32_model.py").write_text(REPEAT_INT32)
        create_python_neuropod(dest, "repeat_int32", [], [{"python_root": code, "dirs_to_package": [""]}],
                               "repeat_int32_model", "get_model",
                               _spec([("IN", "int32", ["n"]), ("DELAY", "uint32", ["n"]), ("WAIT", "uint32", [1])]),
                               _spec([("OUT", "int32", [1]), ("IDX", "uint32", [1])]), decoupled=True)  # fmt: skip


def build_models(repo: Path) -> list[str]:
    """Write the example models into ``repo``; returns their names."""
    from onnx import TensorProto as T
    from onnx import helper

    from neuropod.packagers import create_onnx_neuropod

    def package(name: str, nodes: list[Any], inputs: list[tuple[str, str, list[Any]]],
                outputs: list[tuple[str, str, list[Any]]], onnx_types: dict[str, int],
                inits: list[Any] = (), **kw: Any) -> None:  # type: ignore[assignment]  # fmt: skip
        def shape(s: list[Any]) -> list[Any]:
            return [d if d is not None else "n" for d in s]

        model = _onnx(nodes, [(n, onnx_types[n], shape(s)) for n, _, s in inputs],
                      [(n, onnx_types[n], shape(s)) for n, _, s in outputs], inits)  # fmt: skip
        create_onnx_neuropod(repo / name, name, input_spec=_spec(inputs), output_spec=_spec(outputs),
                             onnx_model=model, **kw)  # fmt: skip

    row = ["batch_size", 16]
    io = ["INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"]
    add_sub = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
               helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]  # fmt: skip
    package("simple", add_sub, [("INPUT0", "int32", row), ("INPUT1", "int32", row)],
            [("OUTPUT0", "int32", row), ("OUTPUT1", "int32", row)], dict.fromkeys(io, T.INT32))  # fmt: skip
    # INT8 arithmetic in int32, cast back (wrapping as Triton's INT8 example model does).
    int8_nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=T.INT32), helper.make_node("Cast", ["INPUT1"], ["b"], to=T.INT32),
        helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Sub", ["a", "b"], ["d"]),
        helper.make_node("Cast", ["s"], ["OUTPUT0"], to=T.INT8), helper.make_node("Cast", ["d"], ["OUTPUT1"], to=T.INT8),
    ]  # fmt: skip
    package("simple_int8", int8_nodes, [("INPUT0", "int8", row), ("INPUT1", "int8", row)],
            [("OUTPUT0", "int8", row), ("OUTPUT1", "int8", row)], dict.fromkeys(io, T.INT8))  # fmt: skip
    # Strings holding decimal integers: parsed, added and subtracted in int32, written back as strings.
    string_nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=T.INT32), helper.make_node("Cast", ["INPUT1"], ["b"], to=T.INT32),
        helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Sub", ["a", "b"], ["d"]),
        helper.make_node("Cast", ["s"], ["OUTPUT0"], to=T.STRING),
        helper.make_node("Cast", ["d"], ["OUTPUT1"], to=T.STRING),
    ]  # fmt: skip
    package("simple_string", string_nodes, [("INPUT0", "string", row), ("INPUT1", "string", row)],
            [("OUTPUT0", "string", row), ("OUTPUT1", "string", row)], dict.fromkeys(io, T.STRING))  # fmt: skip
    identity = [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])]
    package("simple_identity", identity, [("INPUT0", "string", ["batch_size", None])],
            [("OUTPUT0", "string", ["batch_size", None])], {"INPUT0": T.STRING, "OUTPUT0": T.STRING})  # fmt: skip
    package("custom_identity_int32", identity, [("INPUT0", "int32", ["batch_size", None])],
            [("OUTPUT0", "int32", ["batch_size", None])], {"INPUT0": T.INT32, "OUTPUT0": T.INT32})  # fmt: skip
    # An image classifier's interface: per-channel means through a 1x1 convolution to 1000 scores.
    import numpy as np

    weights = np.random.default_rng(0).standard_normal((1000, 3, 1, 1)).astype(np.float32)
    image_nodes = [
        helper.make_node("Unsqueeze", ["data_0", "axis0"], ["batched"]),
        helper.make_node("GlobalAveragePool", ["batched"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "w"], ["scores"]),
        helper.make_node("Squeeze", ["scores", "axis0"], ["fc6_1"]),
    ]  # fmt: skip
    inits = [helper.make_tensor("axis0", T.INT64, [1], [0]),
             helper.make_tensor("w", T.FLOAT, list(weights.shape), weights.ravel().tolist())]  # fmt: skip
    package("densenet_onnx", image_nodes, [("data_0", "float32", [3, 224, 224])],
            [("fc6_1", "float32", [1000, 1, 1])], {"data_0": T.FLOAT, "fc6_1": T.FLOAT}, inits,
            output_labels={"fc6_1": [f"CLASS_{i}" for i in range(1000)]})  # fmt: skip
    build_repeat_int32(repo / "repeat_int32")
    # Seven models: simple_http_model_control.py checks that the repository holds exactly seven.
    return ["simple", "simple_int8", "simple_string", "simple_identity", "custom_identity_int32", "densenet_onnx",
            "repeat_int32"]  # fmt: skip


def build_sequence_models(repo: Path) -> list[str]:
    """The sequence examples' models in ``repo``, stateful by their packaging keywords; returns their names.

    What each computes is Triton's (its ``docs/examples/model_repository`` ONNX models and its
    ``dyna_sequence`` test backend); ``serving/tests/sequence_models.py`` builds the same for the tests.
    """
    from onnx import TensorProto as T
    from onnx import helper

    from neuropod.packagers import create_onnx_neuropod

    types = {"int32": T.INT32, "uint64": T.UINT64, "string": T.STRING}
    row = ["batch_size", 1]

    def package(name: str, nodes: list[Any], inputs: list[tuple[str, str, list[Any]]], controls: list[str],
                corrid: str | None, inits: list[Any] = (), state: bool = False) -> None:  # type: ignore[assignment]  # fmt: skip
        if corrid is not None:
            inputs = [*inputs, ("CORRID", corrid, row)]
        outputs = [("OUTPUT", "int32", row), *([("ACC_OUT", "int32", row)] if state else [])]
        inputs = [*inputs, *((c, "int32", row) for c in controls), *([("ACC_IN", "int32", row)] if state else [])]
        model = _onnx(nodes, [(n, types[t], s) for n, t, s in inputs], [(n, types[t], s) for n, t, s in outputs], inits)
        kinds = [(c, c) for c in controls] + ([("CORRID", "CORRID")] if corrid else [])
        create_onnx_neuropod(repo / name, name, input_spec=_spec(inputs), output_spec=_spec(outputs), onnx_model=model,
                             sequence_controls=[{"name": n, "kind": f"CONTROL_SEQUENCE_{k}"} for n, k in kinds],
                             state_spec=[{"input_name": "ACC_IN", "output_name": "ACC_OUT"}] if state else None)  # fmt: skip

    value = [("INPUT", "int32", row)]
    package("simple_sequence", [helper.make_node("Add", ["INPUT", "START"], ["sum"]),
                                helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"])],
            value, ["START", "READY"], None)  # fmt: skip
    package("simple_dyna_sequence", [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=T.INT32), helper.make_node("Add", ["INPUT", "START"], ["a"]),
        helper.make_node("Mul", ["END", "corrid"], ["b"]), helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
    ], value, ["START", "END", "READY"], "uint64")  # fmt: skip
    # acc = (START ? 0 : acc) + sum(INPUT) + END * int(CORRID) when READY, else unchanged; OUTPUT = acc.
    accumulate = [
        helper.make_node("Sub", ["one", "START"], ["not_start"]), helper.make_node("Mul", ["ACC_IN", "not_start"], ["kept"]),
        helper.make_node("ReduceSum", ["INPUT", "axis1"], ["total"], keepdims=1),
        helper.make_node("Add", ["kept", "total"], ["acc0"]), helper.make_node("Cast", ["CORRID"], ["corrid"], to=T.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["at_end"]), helper.make_node("Add", ["acc0", "at_end"], ["acc1"]),
        helper.make_node("Sub", ["acc1", "ACC_IN"], ["change"]), helper.make_node("Mul", ["READY", "change"], ["ready"]),
        helper.make_node("Add", ["ACC_IN", "ready"], ["ACC_OUT"]), helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
    ]  # fmt: skip
    inits = [helper.make_tensor("one", T.INT32, [], [1]), helper.make_tensor("axis1", T.INT64, [1], [1])]
    with warnings.catch_warnings():
        # Packaging's check of the state runs one step with an id that is not a decimal string, which this model
        # refuses (as Triton's backend does): the check is skipped with a warning.
        warnings.filterwarnings("ignore", "The state outputs of model", UserWarning)
        package("simple_string_dyna_sequence", accumulate, value, ["START", "END", "READY"], "string", inits,
                state=True)  # fmt: skip
    return ["simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence"]


#: Where ``ensemble_models.py`` is: ``preprocess_inception_ensemble``, built as the serving tests build it.
SERVING_TESTS = Path(__file__).resolve().parent.parent / "serving" / "tests"


def build_ensemble(repo: Path, via: str) -> tuple[list[str], dict[str, Any] | None]:
    """``preprocess_inception_ensemble`` in ``repo``: one pipeline package (``via`` "pipeline"), or its two
    steps (``via`` "config"). Returns the names to wait for and, for "config", Triton's ensemble
    configuration to load it with."""
    sys.path.insert(0, str(SERVING_TESTS))
    try:
        import ensemble_models  # lazy: it imports onnx and numpy, as this script's other model builders do
    finally:
        sys.path.remove(str(SERVING_TESTS))
    names: list[str] = ensemble_models.ensemble_repository(repo, via=via)
    return names, ensemble_models.triton_config() if via == "config" else None


#: What Triton's densenet_onnx ``config.pbtxt`` says that a package does not: the input's layout.
DENSENET_CONFIG = {"input": [{"name": "data_0", "data_type": "TYPE_FP32", "format": "FORMAT_NCHW", "dims": [3, 224, 224]}]}


def write_image(path: Path) -> None:
    """A small JPEG for the image examples (they resize it to the model's input)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(path, "JPEG")


# -- server ------------------------------------------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of an earlier run in TIME_WAIT do not count, as for the server)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Server:
    """``neuropod serve`` in its own process group, its output in a log file."""

    def __init__(self, repo: Path, log: Path, *, default_ports: bool = True) -> None:
        if default_ports and _port_free(8000) and _port_free(8001):
            self.http_port, self.grpc_port = 8000, 8001
        else:
            self.http_port, self.grpc_port = free_port(), free_port()
        self.log = log
        self.command = [sys.executable, "-m", "neuropod", "serve", str(repo), "--http-port", str(self.http_port),
                        "--grpc-port", str(self.grpc_port), "--metrics-port", "0", "--allow-client-shm",
                        "--max-batch-size", "8", "--quiet"]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def default_ports(self) -> bool:
        return (self.http_port, self.grpc_port) == (8000, 8001)

    def start(self, models: list[str], timeout: float = 120.0) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        urls = [f"http://127.0.0.1:{self.http_port}{path}" for path in
                ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in models)]]  # fmt: skip
        wait_ready(self.proc, "neuropod serve", self.log, urls, timeout, error=SystemExit)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        """SIGTERM to the server's group, SIGKILL after 15 s."""
        if self.proc is not None:
            stop_group(self.proc, ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)))
        self.proc = None


# -- runs --------------------------------------------------------------------------------------------------------------


def copy_examples(arg: Path, dest: Path) -> str:
    """Copy the example scripts into ``dest``; returns where they came from.

    ``arg`` is a checkout, its ``src/python/examples`` folder, or a clone without a
    work tree (a bare or mirror clone: the scripts are read from its HEAD).
    """
    for candidate in (arg / "src" / "python" / "examples", arg):
        if (candidate / "simple_http_infer_client.py").is_file():
            shutil.copytree(candidate, dest, ignore=shutil.ignore_patterns("CMakeLists.txt"))
            return str(candidate)
    folder = "src/python/examples"
    listing = subprocess.run(["git", "-C", str(arg), "ls-tree", "--name-only", "HEAD", f"{folder}/"],
                             capture_output=True, text=True)  # fmt: skip
    names = [n for n in listing.stdout.split() if n.endswith(".py")] if listing.returncode == 0 else []
    if not names:
        raise SystemExit(f"{arg}: neither a triton-inference-server/client checkout (or clone) nor its {folder} folder")
    dest.mkdir(parents=True)
    for name in names:
        text = subprocess.run(["git", "-C", str(arg), "show", f"HEAD:{name}"], capture_output=True, check=True).stdout
        (dest / Path(name).name).write_bytes(text)
    commit = subprocess.run(["git", "-C", str(arg), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return f"{arg} at {commit[:12]}"


def cuda_shm_missing() -> str:
    """Why the CUDA shared-memory examples cannot run here ("" when they can)."""
    try:
        if subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode != 0:
            return "needs a CUDA GPU (CUDA shared memory); this machine has none"
    except (OSError, subprocess.TimeoutExpired):
        return "needs a CUDA GPU (CUDA shared memory); this machine has none"
    import importlib.util

    if importlib.util.find_spec("cuda") is None:
        return "needs cuda-python for tritonclient's CUDA shared memory (pip install 'tritonclient[cuda]')"
    return ""


#: aiohttp's warnings at interpreter exit, which follow the line that says what failed.
_NOISE = ("Unclosed connector", "Unclosed client session", "connections:", "connector:", "client_session:")


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(_NOISE)]
    return lines[-1][:160] if lines else "(no output)"


def execute(run: Run, folder: Path, server: Server, seq: Server, image: Path, timeout: float, no_cuda: str,
            verbose: bool) -> None:  # fmt: skip
    if run.skip:
        run.status, run.detail = "SKIP", run.skip
        return
    if run.needs_gpu and no_cuda:
        run.status, run.detail = "SKIP", no_cuda
        return
    if run.needs_default_ports and not server.default_ports:
        run.status, run.detail = "SKIP", "hard-codes localhost:8000/8001, which another process holds"
        return
    values = {"http": f"localhost:{server.http_port}", "grpc": f"localhost:{server.grpc_port}", "image": str(image),
              "seq_http": f"localhost:{seq.http_port}", "seq_grpc": f"localhost:{seq.grpc_port}"}  # fmt: skip
    cmd = [sys.executable, str(folder / run.script), *(a.format(**values) for a in run.args)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        run.seconds = time.monotonic() - t0
        run.status, run.detail = "FAIL", f"timed out after {timeout:g} s: {last_line(str(e.stdout or ''))}"
        return
    run.seconds = time.monotonic() - t0
    output = (proc.stdout or "") + (proc.stderr or "")
    if verbose:
        print(f"--- {run.script} {run.variant} (exit {proc.returncode})\n{output[-4000:]}", flush=True)
    if proc.returncode == 0:
        run.status = "PASS"
    else:
        run.status, run.detail = "FAIL", f"exit {proc.returncode}: {last_line(output)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=Path, required=True,
                        help="a triton-inference-server/client checkout, or its src/python/examples folder")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take (default 60)")
    parser.add_argument("--only", nargs="*", default=[], help="run only scripts whose name contains one of these")
    parser.add_argument("--ensemble", choices=["pipeline", "config"], default="pipeline",
                        help="preprocess_inception_ensemble as one pipeline package (default), or as Triton's "
                        "ensemble configuration loaded over its two served steps")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="print each run's output")
    parser.add_argument("--json", type=Path, help="write the table here as JSON")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="neuropod-triton-examples-"))
    server: Server | None = None
    seq: Server | None = None
    old_cache = os.environ.get("NEUROPOD_CACHE_DIR")
    try:
        folder = tmp / "examples"
        source = copy_examples(args.examples.resolve(), folder)
        repo = tmp / "models"
        repo.mkdir()
        os.environ["NEUROPOD_CACHE_DIR"] = str(tmp / "cache")
        models = build_models(repo)
        seq_repo = tmp / "sequence_models"
        seq_repo.mkdir()
        seq_models = build_sequence_models(seq_repo)
        ensemble_models, ensemble_config = build_ensemble(seq_repo, args.ensemble)
        image = tmp / "image.jpg"
        write_image(image)
        no_cuda = cuda_shm_missing()
        server = Server(repo, tmp / "server.log")
        server.start(models)
        seq = Server(seq_repo, tmp / "sequence_server.log", default_ports=False)
        seq.start(seq_models + ensemble_models)
        if ensemble_config is not None:
            name = ensemble_config["name"]
            status, body = seq.post(f"/v2/repository/models/{name}/load",
                                    {"parameters": {"config": json.dumps(ensemble_config)}})  # fmt: skip
            if status != 200:
                print(f"note: {name} did not load with Triton's ensemble configuration ({status}: {body})", flush=True)
        status, body = server.post("/v2/repository/models/densenet_onnx/load",
                                   {"parameters": {"config": json.dumps(DENSENET_CONFIG)}})  # fmt: skip
        if status != 200:
            print(f"note: densenet_onnx did not load with its input format ({status}: {body})", flush=True)
        print(f"neuropod serve on HTTP {server.http_port}, gRPC {server.grpc_port} (sequence models and "
              f"preprocess_inception_ensemble as a {args.ensemble}: HTTP {seq.http_port}, gRPC {seq.grpc_port}); "
              f"examples from {source}", flush=True)  # fmt: skip
        runs = [r for r in plan() if not args.only or any(o in r.script for o in args.only)]
        for run in runs:
            execute(run, folder, server, seq, image, args.timeout, no_cuda, args.verbose)
            known = f"  [expected: {run.known}]" if run.status == "FAIL" and run.known else ""
            print(f"{run.script:<52} {run.variant:<6} {run.status:<5} {run.detail}{known}", flush=True)
            exited = next((s for s in (server, seq) if s.proc is not None and s.proc.poll() is not None), None)
            if exited is not None and exited.proc is not None:
                print(f"a server exited ({exited.proc.returncode}):\n{exited.tail()}", flush=True)
                break
    finally:
        for s in (server, seq):
            if s is not None:
                s.stop()
        if old_cache is None:
            os.environ.pop("NEUROPOD_CACHE_DIR", None)
        else:
            os.environ["NEUROPOD_CACHE_DIR"] = old_cache
        shutil.rmtree(tmp, ignore_errors=True)

    done = [r for r in runs if r.status]
    counts = {s: sum(r.status == s for r in done) for s in ("PASS", "FAIL", "SKIP")}
    expected = sum(r.status == "FAIL" and bool(r.known) for r in done)
    print(f"\n{counts['PASS']} of {len(done)} runs pass ({counts['FAIL']} fail, {expected} of them as expected; "
          f"{counts['SKIP']} skipped)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([{"script": r.script, "variant": r.variant, "status": r.status,
                                          "detail": r.detail, "expected_failure": r.known,
                                          "seconds": round(r.seconds, 2)} for r in done], indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
