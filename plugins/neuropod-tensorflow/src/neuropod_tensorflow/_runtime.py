"""TensorFlow sessions and SavedModel signatures behind a loaded model.

Two kinds of package, as the original Neuropod wrote them and as we do:

* a frozen ``GraphDef`` at ``0/data/model.pb`` with ``node_name_mapping`` in
  ``0/config.json`` (spec name -> tensor name; ``:0`` optional), run with a
  ``tf.compat.v1.Session``; one callable is made per combination of inputs
  and requested outputs (``Session.make_callable``), which costs less per
  call than ``Session.run`` with a feed dict;
* a SavedModel at ``0/data/savedmodel``, run through its ``serving_default``
  signature, whose input and output keys are the spec's names.

TensorFlow is imported, and models loaded, with its C++ start-up logs held
back (:mod:`neuropod_tensorflow._quiet`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuropod.backend import load_libraries_once
from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package
from neuropod.spec import TensorSpec, to_bytes_array, to_string_array
from neuropod_tensorflow._ops_probe import clash
from neuropod_tensorflow._quiet import LOCK, import_tensorflow, quiet_stderr

FROZEN_GRAPH = "model.pb"
SAVED_MODEL = "savedmodel"
SIGNATURE = "serving_default"

LOAD_OPTIONS = {
    "intra_op_num_threads": "threads inside one operator (per session for frozen graphs; process-wide for SavedModels)",
    "inter_op_num_threads": "threads across operators (as above)",
    "inter_op_thread_pool": "frozen graphs: 'caller' (default: run ops on the calling thread) or 'pool' (TensorFlow's pool)",
}

# --- shared pieces -----------------------------------------------------------------


def load_custom_ops(tf: Any, paths: Sequence[Path], where: str) -> None:
    """``tf.load_op_library`` each library once per process per file content.

    A library whose ops this process has from another file is not loaded:
    :func:`~neuropod_tensorflow._ops_probe.clash` says so, and the core runs
    the model in a worker process instead.
    """
    if not paths:
        return
    load_libraries_once(
        paths, tf.load_op_library, f"tensorflow {tf.__version__}", where, clash=lambda path: clash(tf, path, where)
    )


def _threads(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in LOAD_OPTIONS.items())
        raise NeuropodError(f"Unknown TensorFlow load option(s) {', '.join(map(repr, unknown))}. Known: {known}")
    out: dict[str, Any] = {"inter_op_thread_pool": options.get("inter_op_thread_pool", "caller")}
    if out["inter_op_thread_pool"] not in ("caller", "pool"):
        raise NeuropodError(f"inter_op_thread_pool must be 'caller' or 'pool', not {out['inter_op_thread_pool']!r}")
    for key, value in options.items():
        if key == "inter_op_thread_pool":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise NeuropodError(f"Load option {key} must be an int >= 0 (0: TensorFlow's default), not {value!r}")
        out[key] = value
    return out


def _to_numpy(value: Any, spec: TensorSpec | None) -> np.ndarray:
    # TensorFlow gives a 0-d output as a numpy scalar (np.float32(3.0)); a model's outputs are arrays.
    if spec is not None and spec.dtype == "bytes":
        return to_bytes_array(value)  # TensorFlow's strings are bytes, and so are the spec's: given as they are
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.dtype.kind in "OS" or (spec is not None and spec.dtype == "string"):
        return to_string_array(arr)  # TensorFlow returns bytes; the spec says str
    return arr


def load(package: Package, device: str, options: Mapping[str, Any]) -> FrozenGraphModel | SavedModelModel:
    """Load whichever kind of TensorFlow model the package holds."""
    where = f"Model {package.name!r} ({package.source})"
    threads = _threads(options)
    tf = import_tensorflow()
    if device != "cpu" and not tf.config.list_physical_devices("GPU"):
        raise NeuropodError(
            f"{where}: device {device!r} was asked for, but tensorflow {tf.__version__} sees no GPU "
            f"({'a CPU-only build' if not tf.test.is_built_with_cuda() else 'no usable GPU or CUDA libraries'}); "
            "load with device='cpu'"
        )
    with quiet_stderr(f"loading model {package.name!r}"):
        load_custom_ops(tf, package.custom_op_paths, where)
        if (package.data_dir / SAVED_MODEL).is_dir():
            return SavedModelModel(tf, package, device, threads, where)
        if (package.data_dir / FROZEN_GRAPH).is_file():
            return FrozenGraphModel(tf, package, device, threads, where)
    raise PackageError(f"{where}: found neither 0/data/{FROZEN_GRAPH} nor 0/data/{SAVED_MODEL}/")


# --- frozen graphs -----------------------------------------------------------------


def _tensor_name(name: str) -> str:
    return name if ":" in name else f"{name}:0"


class FrozenGraphModel:
    """A frozen GraphDef in its own graph and session."""

    def __init__(self, tf: Any, package: Package, device: str, threads: Mapping[str, Any], where: str):
        self.name = package.name
        self.where = where
        self._caller_thread = threads["inter_op_thread_pool"] == "caller"
        config = package.config
        mapping = package.backend_config.get("node_name_mapping")
        if not isinstance(mapping, dict):
            raise PackageError(f"{where}: 0/config.json has no node_name_mapping (spec name -> graph tensor name)")
        graph_def = tf.compat.v1.GraphDef()
        try:
            graph_def.ParseFromString((package.data_dir / FROZEN_GRAPH).read_bytes())
            self.graph = tf.Graph()
            with self.graph.as_default():
                tf.import_graph_def(graph_def, name="")
        except Exception as e:
            raise BackendError(f"{where}: tensorflow {tf.__version__} could not import 0/data/{FROZEN_GRAPH}: {e}") from e
        self._tensors: dict[str, Any] = {}
        for kind, specs in (("input", config.input_spec), ("output", config.output_spec)):
            for spec in specs:
                node = mapping.get(spec.name)
                if not isinstance(node, str):
                    raise PackageError(f"{where}: node_name_mapping has no entry for {kind} {spec.name!r}")
                self._tensors[spec.name] = self._find(tf, _tensor_name(node), spec.name, kind)
        session_config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
        session_config.intra_op_parallelism_threads = threads.get("intra_op_num_threads", 0)
        session_config.inter_op_parallelism_threads = threads.get("inter_op_num_threads", 0)
        if device == "cpu":
            session_config.device_count["GPU"] = 0
        else:
            session_config.gpu_options.visible_device_list = device.split(":", 1)[1]
            session_config.gpu_options.allow_growth = True
        self.session = tf.compat.v1.Session(graph=self.graph, config=session_config)
        init_ops = package.backend_config.get("init_op_names") or []
        if init_ops:
            try:
                self.session.run(list(init_ops))
            except Exception as e:
                raise BackendError(f"{where}: running init ops {list(init_ops)} failed: {e}") from e
        self._specs = {s.name: s for s in config.output_spec}
        self._all_outputs = tuple(s.name for s in config.output_spec)
        # Outputs that need more than the session gives: strings (bytes -> str) and 0-d ones (numpy scalars, or
        # bytes, -> arrays).
        self._convert = frozenset(s.name for s in config.output_spec if s.dtype == "string" or s.shape == ())
        self._callables: dict[tuple[tuple[str, ...], tuple[str, ...]], Callable[..., Any]] = {}

    def _find(self, tf: Any, tensor: str, spec_name: str, kind: str) -> Any:
        try:
            return self.graph.get_tensor_by_name(tensor)
        except (KeyError, ValueError):
            ops = self.graph.get_operations()
            if kind == "input":
                have = [op.name for op in ops if op.type == "Placeholder"]
                what = "placeholders"
            else:
                have = [op.name for op in ops if op.type not in ("Const", "Placeholder", "NoOp")][-20:]
                what = "last ops"
            raise SpecError(
                f"{self.where}: {kind} {spec_name!r} maps to {tensor!r}, which is not in the graph; "
                f"the graph's {what}: {', '.join(have) or 'none'}"
            ) from None

    def run(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        names = tuple(inputs)
        outputs = self._all_outputs if requested is None else tuple(requested)
        key = (names, outputs)
        fn = self._callables.get(key)
        if fn is None:
            # Making a callable and its first run are when TensorFlow optimizes
            # the graph, and some releases log about that to stderr (2.18:
            # "MLIR V1 optimization pass is not enabled"); hold that back too.
            with quiet_stderr(f"first running model {self.name!r}"):
                fn = self._make_callable(names, outputs)
                results = fn(*inputs.values())
        else:
            results = fn(*inputs.values())
        if not self._convert:
            return dict(zip(outputs, results))
        specs = self._specs
        return {
            name: _to_numpy(value, specs[name]) if name in self._convert else value
            for name, value in zip(outputs, results)
        }

    def _make_callable(self, names: tuple[str, ...], outputs: tuple[str, ...]) -> Callable[..., Any]:
        fetches = [self._tensors[n] for n in outputs]
        feeds = [self._tensors[n] for n in names]
        with LOCK:
            fn = self._caller_thread_callable(feeds, fetches) if self._caller_thread else None
            if fn is None:
                fn = self.session.make_callable(fetches, feed_list=feeds)
            self._callables[(names, outputs)] = fn
            return fn

    def _caller_thread_callable(self, feeds: list[Any], fetches: list[Any]) -> Callable[..., Any] | None:
        """A callable that runs the graph on the calling thread (``inter_op_thread_pool=-1``).

        Handing a run to TensorFlow's inter-op pool and waiting for it costs
        tens of microseconds, more than a small graph's whole run (on the
        original Neuropod's addition model: about 150 us through the pool,
        4 us on the calling thread). Operators still use the intra-op pool
        for their own parallelism; what is lost is running independent
        branches at once, so graphs with wide parallel branches or blocking
        queue ops should load with ``inter_op_thread_pool="pool"``.
        Session.make_callable cannot take RunOptions without paying for them
        on every call, so this uses the session's options-based constructor
        (private in TensorFlow's Python API) and falls back to
        make_callable if it is missing.
        """
        make = getattr(self.session, "_make_callable_from_options", None)
        try:
            from tensorflow.core.protobuf import config_pb2
        except ImportError:
            return None
        if make is None:
            return None
        options = config_pb2.CallableOptions()
        options.feed.extend(t.name for t in feeds)
        options.fetch.extend(t.name for t in fetches)
        options.run_options.inter_op_thread_pool = -1
        return make(options)  # type: ignore[no-any-return]

    def close(self) -> None:
        session = self.__dict__.pop("session", None)
        if session is not None:
            session.close()
        self._callables.clear()


# --- SavedModels ---------------------------------------------------------------------


class SavedModelModel:
    """A SavedModel's ``serving_default`` signature, called eagerly."""

    def __init__(self, tf: Any, package: Package, device: str, threads: Mapping[str, Any], where: str):
        self.name = package.name
        self.tf = tf
        self._device = "/CPU:0" if device == "cpu" else f"/GPU:{device.split(':', 1)[1]}"
        _process_threads(tf, threads, where)
        path = package.data_dir / SAVED_MODEL
        try:
            with tf.device(self._device):
                self.loaded = tf.saved_model.load(str(path))
        except Exception as e:
            raise BackendError(f"{where}: tensorflow {tf.__version__} could not load 0/data/{SAVED_MODEL}: {e}") from e
        signatures = dict(getattr(self.loaded, "signatures", {}) or {})
        if SIGNATURE not in signatures:
            raise PackageError(
                f"{where}: the SavedModel has no {SIGNATURE!r} signature (it has: "
                f"{', '.join(map(repr, signatures)) or 'none'}); save it with "
                f"signatures={{'{SIGNATURE}': fn}}"
            )
        self.signature = signatures[SIGNATURE]
        _, kwargs = self.signature.structured_input_signature
        outputs = self.signature.structured_outputs
        config = package.config
        self._check_keys(where, "input", [s.name for s in config.input_spec], sorted(kwargs), True)
        self._check_keys(where, "output", [s.name for s in config.output_spec], sorted(outputs), False)
        self._input_dtypes = {name: spec.dtype for name, spec in kwargs.items()}
        self._specs = {s.name: s for s in config.output_spec}
        self._all_outputs = tuple(self._specs)
        self._first_call = True

    @staticmethod
    def _check_keys(where: str, kind: str, spec_names: list[str], keys: list[str], exact: bool) -> None:
        """A PackageError (a ValueError, as the original's packager raised, in its words) when they differ."""
        missing = [n for n in spec_names if n not in keys]
        extra = [k for k in keys if k not in spec_names] if exact else []
        if missing or extra:
            parts = []
            if missing:
                said = "is missing the following inputs" if kind == "input" else "does not return the following outputs"
                parts.append(f"The supplied SavedModel {said} in the spec: {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"The supplied SavedModel expects inputs that are not in the spec: {', '.join(map(repr, extra))}")
            raise PackageError(
                f"{where}: the {SIGNATURE!r} signature's {kind} keys do not match the {kind} spec. "
                f"{'. '.join(parts)}. Signature keys: {', '.join(map(repr, keys))}"
            )

    def run(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        if len(inputs) != len(self._input_dtypes):
            missing = [n for n in self._input_dtypes if n not in inputs]
            raise SpecError(f"Model {self.name!r} needs input(s) {', '.join(map(repr, missing))}: its signature has no defaults")
        if self._first_call:  # see FrozenGraphModel.run
            with quiet_stderr(f"first running model {self.name!r}"), self.tf.device(self._device):
                result = self.signature(**inputs)
            self._first_call = False
        else:
            with self.tf.device(self._device):
                result = self.signature(**inputs)
        specs = self._specs
        # The signature may return more than the spec describes; return what the spec names.
        names = self._all_outputs if requested is None else requested
        return {name: _to_numpy(result[name].numpy(), specs[name]) for name in names}

    def close(self) -> None:
        self.__dict__.pop("signature", None)
        self.__dict__.pop("loaded", None)


def _process_threads(tf: Any, threads: Mapping[str, int], where: str) -> None:
    for key, getter, setter in (
        ("intra_op_num_threads", tf.config.threading.get_intra_op_parallelism_threads,
         tf.config.threading.set_intra_op_parallelism_threads),
        ("inter_op_num_threads", tf.config.threading.get_inter_op_parallelism_threads,
         tf.config.threading.set_inter_op_parallelism_threads),
    ):  # fmt: skip
        if key in threads and getter() != threads[key]:
            try:
                setter(threads[key])
            except RuntimeError as e:
                raise NeuropodError(
                    f"{where}: cannot set {key}={threads[key]} for a SavedModel: TensorFlow allows it only before "
                    f"its runtime starts, process-wide ({e})"
                ) from e
