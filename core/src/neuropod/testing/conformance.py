"""The backend conformance suite: :class:`BackendConformance` and what its tests use (the dtypes,
:func:`covers`, :func:`sample`, :class:`HostTensor`, :func:`run_in_threads`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import importlib_metadata
import numpy as np
import pytest

from neuropod import plugins
from neuropod.backend import Backend, DeviceCaps
from neuropod.errors import NeuropodError, SpecError
from neuropod.loader import load_neuropod
from neuropod.package import read_package
from neuropod.testdata import run_test_data
from neuropod.testing.marks import covers
from neuropod.testing.stateful import StatefulConformance

#: Every dtype a spec can name.
ALL_DTYPES: tuple[str, ...] = (
    "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "string",
)  # fmt: skip
#: The same, without strings.
NUMERIC_DTYPES: tuple[str, ...] = tuple(d for d in ALL_DTYPES if d != "string")


def hooks_covered(suite: type[BackendConformance] | None = None) -> dict[str, frozenset[str]]:
    """Test method name to the hooks it exercises, for the suite or a subclass."""
    cls = suite or BackendConformance
    found = {}
    for name in dir(cls):
        if name.startswith("test_"):
            hooks = getattr(getattr(cls, name), "_neuropod_hooks", None)
            if hooks is not None:
                found[name] = hooks
    return found


def sample(dtype: str, shape: Sequence[int], seed: int = 0) -> np.ndarray:
    """Random test data of a spec dtype: strings as a numpy unicode array."""
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    if dtype == "string":
        words = np.array(["neuropod", "ünïcode", "", "a b", "x" * 20, "42"])
        return words[rng.integers(0, len(words), shape)].astype(str)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    np_dtype = np.dtype(dtype)
    if np_dtype.kind == "f":
        return rng.standard_normal(shape).astype(np_dtype)
    info = np.iinfo(np_dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape, endpoint=True).astype(np_dtype)


class BackendConformance(StatefulConformance):
    """The tests every backend must pass; subclass it in the backend's tests.

    Set the class attributes and implement :meth:`make_package`; override
    :meth:`custom_op_library` when ``custom_ops`` is True.
    """

    #: The package platform the backend runs, e.g. ``"onnx"``.
    platform: ClassVar[str]
    #: Its entry-point name in ``neuropod.backends``; the platform by default.
    entry_point: ClassVar[str | None] = None
    #: The plugin's distribution name, e.g. ``"neuropod-onnx"``.
    distribution: ClassVar[str]
    #: Modules that listing backends and their devices must not import.
    framework_modules: ClassVar[tuple[str, ...]] = ()
    #: The spec dtypes the backend runs ("string" included or not).
    dtypes: ClassVar[tuple[str, ...]] = NUMERIC_DTYPES
    #: Whether the backend loads custom-op libraries (``package.custom_op_paths``).
    custom_ops: ClassVar[bool] = False
    #: The device the suite loads models onto.
    device: ClassVar[str] = "cpu"
    #: Whether the backend's :class:`DeviceCaps` say it runs on the CPU.
    runs_on_cpu: ClassVar[bool] = True
    #: Marks for the tests that run a model (e.g. a GPU-only backend's skip).
    run_marks: ClassVar[Sequence[pytest.MarkDecorator]] = ()
    #: Threads and calls per thread in the thread-safety test.
    threads: ClassVar[int] = 8
    calls_per_thread: ClassVar[int] = 25

    # --- what a backend provides ------------------------------------------

    def make_package(
        self,
        tmp_path: Path,
        name: str,
        input_spec: list[dict[str, Any]],
        output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """Package a small real model of this platform and return its path.

        The model copies each input to an output: ``output_spec[i]`` (named
        ``out_<s>``) is input ``input_spec[i]`` (named ``in_<s>``), same dtype
        and shape. All entries of one call share a dtype. Pass
        ``packager_kwargs`` (``test_input_data``, ``test_expected_out``,
        ``custom_ops``) to the platform's packager; write the package under
        ``tmp_path / name``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement make_package")

    def custom_op_library(self, tmp_path: Path) -> Path | None:
        """A custom-op shared library the backend can load, or None to skip that test."""
        return None

    # --- helpers -----------------------------------------------------------

    @property
    def _ep_name(self) -> str:
        return self.entry_point or self.platform

    def _entry_point(self) -> Any:
        eps = [ep for ep in importlib_metadata.entry_points(group=plugins.ENTRY_POINT_GROUP) if ep.name == self._ep_name]
        assert eps, (
            f"no entry point {self._ep_name!r} in group {plugins.ENTRY_POINT_GROUP!r}: is {self.distribution} installed?"
        )
        return eps[0]

    def _backends(self) -> list[Backend]:
        return [b for b in plugins.installed_backends() if b.platform == self.platform and b.plugin == self._ep_name]

    def _in_process(self) -> list[Backend]:
        return [b for b in self._backends() if b.location == "in-process"]

    def _backend(self) -> Backend:
        backends = self._in_process()
        if not backends:
            pytest.skip(f"no {self.platform} backend is installed here (the {self.distribution} framework is missing)")
        return backends[0]

    def _pair_spec(self, dtype: str, suffixes: Sequence[str], shape: Sequence[Any] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        if shape is None:
            # Strings are 1-D: some frameworks (TorchScript) take them as a list.
            shape = ["batch"] if dtype == "string" else ["batch", 3]
        ins = [{"name": f"in_{s}", "dtype": dtype, "shape": list(shape)} for s in suffixes]
        outs = [{"name": f"out_{s}", "dtype": dtype, "shape": list(shape)} for s in suffixes]
        return ins, outs

    def _inputs(self, dtype: str, suffixes: Sequence[str], batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
        shape = (batch,) if dtype == "string" else (batch, 3)
        return {f"in_{s}": sample(dtype, shape, seed + i) for i, s in enumerate(suffixes)}

    def _first_dtype(self) -> str:
        return "float32" if "float32" in self.dtypes else self.dtypes[0]

    def _load(self, path: Path, **options: Any) -> Any:
        return load_neuropod(path, device=self.device, backend=self.platform, **options)

    @staticmethod
    def _assert_copies(outputs: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]) -> None:
        for name, arr in inputs.items():
            out = outputs["out_" + name[len("in_"):]]
            assert out.shape == arr.shape, f"{name}: shape {out.shape}, expected {arr.shape}"
            if arr.dtype.kind == "U":
                assert [str(v) for v in out.tolist()] == arr.tolist(), name
            else:
                assert out.dtype == arr.dtype, f"{name}: dtype {out.dtype}, expected {arr.dtype}"
                np.testing.assert_array_equal(out, arr)

    @pytest.fixture(autouse=True)
    def _conformance_setup(self, neuropod_cache: Path) -> Any:
        # Each test sees the plugins as installed (no registrations left by other tests).
        plugins.reset()
        yield
        plugins.reset()

    # --- the suite ---------------------------------------------------------

    @covers("supported_versions")
    def test_discovered_through_entry_point(self) -> None:
        ep = self._entry_point()
        module = ep.load()
        assert hasattr(module, "supported_versions"), f"{ep.value} has no supported_versions hook"
        assert ep.dist is not None and ep.dist.name.replace("_", "-").lower() == self.distribution.lower()
        assert self._ep_name in {i.name for i in plugins.plugin_infos()}, plugins.plugin_failures()
        assert not [f for f in plugins.plugin_failures() if f.name == self._ep_name]
        for b in self._backends():
            assert b.plugin_distribution == f"{self.distribution} {ep.dist.version}"
            if b.location.startswith("python:"):
                # Another interpreter a lock environment can be built on (the python backend's).
                assert Path(b.location[len("python:"):]).is_file(), b
                continue
            assert b.location == "in-process"
            assert b.version == self.framework_version(b)

    def framework_version(self, backend: Backend) -> str:
        """The version an in-process backend must report: its framework's installed metadata
        (a backend whose framework is not a distribution, such as the Python interpreter, overrides this)."""
        return str(importlib_metadata.version(backend.framework))

    @covers("supported_versions", "device_caps")
    def test_listing_backends_imports_no_framework(self) -> None:
        code = (
            "import sys\n"
            "from neuropod import plugins\n"
            "bs = plugins.installed_backends()\n"
            "caps = [plugins.backend_caps(b) for b in bs]\n"
            f"assert {self._ep_name!r} in plugins.plugin_distributions(), plugins.plugin_failures()\n"
            f"bad = [m for m in {tuple(self.framework_modules)!r} if m in sys.modules]\n"
            "assert not bad, f'listing backends imported {bad}'\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr

    @covers("device_caps", "load_model")
    def test_hooks_answer_none_for_other_platforms(self, tmp_path: Path) -> None:
        module = self._entry_point().load()
        foreign = Backend(platform=f"not-{self.platform}", version="1.0", framework="elsewhere")
        assert module.device_caps(backend=foreign) is None
        if hasattr(module, "load_model"):
            assert module.load_model(package=None, backend=foreign, device="cpu", options={}) is None

    @covers("device_caps")
    def test_device_caps(self) -> None:
        module = self._entry_point().load()
        backends = self._backends() or [Backend(platform=self.platform, version="0.0", framework=self.distribution)]
        for b in backends:
            caps = module.device_caps(backend=b)
            assert isinstance(caps, DeviceCaps), f"device_caps({b}) returned {caps!r}"
            assert caps.cpu is self.runs_on_cpu
            assert caps.cpu or caps.gpu, "a backend must run on some device"
            if caps.gpu:
                assert caps.cuda and all(c.count(".") == 1 for c in caps.compute_capabilities)
            assert isinstance(caps.describe(), str)

    @covers("load_model", "infer", runs_model=True)
    def test_package_with_test_data(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        inputs = self._inputs(dtype, ["a", "b"])
        expected = {"out_" + k[3:]: v for k, v in inputs.items()}
        path = self.make_package(tmp_path, "with_data", ins, outs, test_input_data=inputs, test_expected_out=expected)
        pkg = read_package(path)
        assert pkg.platform == self.platform and pkg.has_test_data
        stored_in, stored_out = pkg.test_data()
        assert stored_out is not None and set(stored_out) == set(expected)
        for k, v in inputs.items():
            np.testing.assert_array_equal(stored_in[k], v)
        report = run_test_data(path, device=self.device, backend=self.platform)
        assert report.passed, report.mismatches
        assert report.backend == self._backend().id

    @covers("load_model", "infer", runs_model=True)
    def test_infer_dtype(self, tmp_path: Path, conformance_dtype: str) -> None:
        ins, outs = self._pair_spec(conformance_dtype, ["a", "b"])
        path = self.make_package(tmp_path, f"copy_{conformance_dtype}", ins, outs)
        with self._load(path) as model:
            assert model.backend == self._backend()
            assert model.device == self.device
            for seed, batch in ((0, 4), (1, 1)):
                inputs = self._inputs(conformance_dtype, ["a", "b"], batch=batch, seed=seed)
                self._assert_copies(model.infer(inputs), inputs)
            if conformance_dtype != "string":
                # Non-contiguous inputs are accepted.
                wide = sample(conformance_dtype, (4, 6), 7)
                inputs = {"in_a": wide[:, ::2], "in_b": np.asfortranarray(wide[:, :3])}
                self._assert_copies(model.infer(inputs), inputs)

    @covers("infer", runs_model=True)
    def test_cpu_tensors_of_other_frameworks(self, tmp_path: Path) -> None:
        """Inputs that another framework holds in host memory (any DLPack producer: torch, JAX...) run as
        numpy arrays do, and the outputs are numpy arrays (the core reads such inputs without a copy)."""
        dtype = self._first_dtype()
        if dtype == "string":
            pytest.skip("DLPack carries no strings, and this backend runs only strings")
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        path = self.make_package(tmp_path, "copy_dlpack", ins, outs)
        inputs = self._inputs(dtype, ["a", "b"], batch=3)
        with self._load(path) as model:
            outputs = model.infer({name: HostTensor(arr) for name, arr in inputs.items()})
            assert all(type(v) is np.ndarray for v in outputs.values()), {k: type(v) for k, v in outputs.items()}
            self._assert_copies(outputs, inputs)

    @covers("infer", runs_model=True)
    def test_symbols_are_validated(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        path = self.make_package(tmp_path, "symbols", ins, outs)
        with self._load(path) as model:
            inputs = self._inputs(dtype, ["a", "b"], batch=3)
            self._assert_copies(model.infer(inputs), inputs)
            inputs["in_b"] = self._inputs(dtype, ["b"], batch=5)["in_b"]
            with pytest.raises(SpecError, match=r"symbol 'batch' should be the same size\. .* size 3 \(from tensor 'in_a'\), but was of size 5"):
                model.infer(inputs)

    @covers("infer", runs_model=True)
    def test_requested_outputs(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b", "c"])
        path = self.make_package(tmp_path, "requested", ins, outs)
        inputs = self._inputs(dtype, ["a", "b", "c"])
        with self._load(path) as model:
            out = model.infer(inputs, requested_outputs=["out_b"])
            assert set(out) == {"out_b"}
            self._assert_copies(out, {"in_b": inputs["in_b"]})
            out = model.infer(inputs, requested_outputs=["out_c", "out_a"])
            assert set(out) == {"out_a", "out_c"}
            self._assert_copies(out, {"in_a": inputs["in_a"], "in_c": inputs["in_c"]})
            with pytest.raises(NeuropodError, match="out_nope"):
                model.infer(inputs, requested_outputs=["out_nope"])

    @covers("load_model", "infer", runs_model=True)
    def test_close_and_reload(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a"])
        path = self.make_package(tmp_path, "reload", ins, outs)
        inputs = self._inputs(dtype, ["a"])
        model = self._load(path)
        self._assert_copies(model.infer(inputs), inputs)
        model.close()
        model.close()  # closing twice is harmless
        with pytest.raises(NeuropodError, match="closed"):
            model.infer(inputs)
        for _ in range(2):
            with self._load(path) as again:
                self._assert_copies(again.infer(inputs), inputs)

    @covers("load_model", "infer", runs_model=True)
    def test_bad_input_is_a_clean_error(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        path = self.make_package(tmp_path, "bad_input", ins, outs)
        with pytest.raises(NeuropodError, match="no_such_option"):
            self._load(path, no_such_option=1)
        inputs = self._inputs(dtype, ["a", "b"])
        other = "int32" if dtype != "int32" else "float32"
        with self._load(path) as model:
            with pytest.raises(SpecError, match="in_a"):
                model.infer({**inputs, "in_a": sample(other, inputs["in_a"].shape)})
            with pytest.raises(SpecError, match="in_zzz"):
                model.infer({**inputs, "in_zzz": inputs["in_a"]})
            with pytest.raises(SpecError, match="in_b"):
                model.infer({**inputs, "in_b": inputs["in_b"][None]})
            with pytest.raises(NeuropodError, match="in_b|out_b"):
                # Left out: the backend names the input, or the core finds out_b missing.
                model.infer({"in_a": inputs["in_a"]})
            self._assert_copies(model.infer(inputs), inputs)  # still usable

    @covers("infer", runs_model=True)
    def test_infer_from_many_threads(self, tmp_path: Path) -> None:
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        path = self.make_package(tmp_path, "threads", ins, outs)
        with self._load(path) as model:

            def work(seed: int) -> None:
                for i in range(self.calls_per_thread):
                    inputs = self._inputs(dtype, ["a", "b"], batch=1 + (seed + i) % 5, seed=seed * 1000 + i)
                    self._assert_copies(model.infer(inputs), inputs)

            run_in_threads(work, self.threads)

    @covers("load_model", "infer", runs_model=True)
    def test_custom_ops(self, tmp_path: Path) -> None:
        if not self.custom_ops:
            pytest.skip(f"the {self.platform} backend does not claim custom ops")
        lib = self.custom_op_library(tmp_path)
        if lib is None:
            pytest.skip(f"{type(self).__name__}.custom_op_library gives no library here")

        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a"])
        path = self.make_package(tmp_path, "custom_ops", ins, outs, custom_ops=[lib])
        pkg = read_package(path)
        assert [p.name for p in pkg.custom_op_paths] == [Path(lib).name]
        assert pkg.custom_op_paths[0].read_bytes() == Path(lib).read_bytes()
        inputs = self._inputs(dtype, ["a"])
        with self._load(path) as model:
            self._assert_copies(model.infer(inputs), inputs)

    @covers("infer_stream", runs_model=True)
    def test_streams(self, tmp_path: Path) -> None:
        """``infer_stream`` works on every backend: an ordinary model answers with its one response.
        A decoupled package loads only where the plugin implements the ``infer_stream`` hook; on any
        other backend it is refused when it is packaged (its check loads it), naming the hook."""
        dtype = self._first_dtype()
        ins, outs = self._pair_spec(dtype, ["a", "b"])
        path = self.make_package(tmp_path, "streamed", ins, outs)
        inputs = self._inputs(dtype, ["a", "b"])
        with self._load(path) as model:
            assert not model.decoupled
            with model.infer_stream(inputs) as stream:
                responses = list(stream)
            assert len(responses) == 1
            self._assert_copies(responses[0], inputs)
            (only_b,) = list(model.infer_stream(inputs, requested_outputs=["out_b"]))
            assert set(only_b) == {"out_b"}
        streams = any(impl.plugin_name == self._ep_name for impl in plugins.get_plugin_manager().hook.infer_stream.get_hookimpls())
        if streams:
            return  # a decoupled model of this backend is the backend's own to build and test
        with pytest.raises(NeuropodError, match="infer_stream"):
            self.make_package(tmp_path, "decoupled", ins, outs, decoupled=True)
        assert not (tmp_path / "decoupled").exists()


class HostTensor:
    """Another framework's tensor in host memory, as the DLPack protocol shows it (numpy's memory behind it)."""

    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._arr.__dlpack_device__()


def run_in_threads(work: Callable[[int], object], threads: int) -> None:
    """Run ``work(0)`` ... ``work(threads - 1)`` at once, each in its own thread,
    and raise the first exception any of them raised (assertion failures included)."""
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            start.wait()
            work(n)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
