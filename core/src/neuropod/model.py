"""The loaded model: ``load_neuropod`` and what it returns."""

from __future__ import annotations

import functools
import math
import numbers
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from neuropod import plugins
from neuropod._args import check_flag, check_parameters, check_seconds, check_workers
from neuropod.backend import Backend
from neuropod.devices import Host, load_host, local_host, parse_device
from neuropod.errors import BackendError, InProcessConflictError, NeuropodError, PackageError
from neuropod.package import Package, read_package
from neuropod.resolve import Resolution, parse_backend_pin, resolve
from neuropod.spec import SpecValidator, TensorSpec
from neuropod.tensors import TensorFacts


class NeuropodModel:
    """A model loaded by a backend onto a device; call :meth:`infer`.

    Use it as a context manager, or call :meth:`close`, to free the
    backend's resources.
    """

    def __init__(self, package: Package, resolution: Resolution, handle: Any):
        chosen = resolution.raise_if_unresolved()
        self.package = package
        self.resolution = resolution
        #: The backend that runs the model.
        self.backend: Backend = chosen.backend
        #: ``"cpu"`` or ``"cuda:N"``.
        self.device: str = chosen.device or "cpu"
        self._handle = handle
        self._validator = SpecValidator(
            package.name, package.config.input_spec, package.config.output_spec,
            shared_symbols=not package.original_format,
        )  # fmt: skip
        self._bind_infer()
        # Subclasses that run the model elsewhere (a worker, a server) override _run.
        self._run_is_the_hook = type(self)._run is NeuropodModel._run
        self._validator.device_policy = self._device_policy()
        self._closed = False
        self._fast = self._fast_call()
        self._close_lock = threading.Lock()

    #: Whether ``infer`` hands GPU tensors to the backend and honours ``output_device`` (set for
    #: in-process models whose backend says it can; workers and remote models take host memory).
    _device_tensors = False
    #: Whether :meth:`_run` is this class's: then ``infer`` calls the bound hook itself.
    _run_is_the_hook = False
    #: The backend's ``infer`` as ``call(model, inputs, requested_outputs, parameters)`` when it
    #: takes request parameters (see :meth:`infer`); None when it does not.
    _infer_with_parameters: Callable[[Any, Any, Any, Any], Any] | None = None
    #: The backend's ``infer`` itself when it takes ``(model, inputs, requested_outputs,
    #: output_device)`` in that order: the common call passes None for the last positionally,
    #: cheaper than :attr:`_infer`'s keyword (see :meth:`_fast_call`).
    _infer_positional: Callable[[Any, Any, Any, Any], Any] | None = None
    #: What the common call needs (see :meth:`_fast_call`); None when it takes :meth:`_checked_infer`.
    _fast: tuple[Any, ...] | None = None

    def _bind_infer(self) -> None:
        # Bound once: the per-call path does not loop over plugins.
        infer_impl = plugins.bound_hook("infer", self.backend)
        self._infer = plugins.infer_caller(infer_impl)
        if tuple(infer_impl.argnames) == plugins.INFER_ARGS_WITH_DEVICE:  # type: ignore[attr-defined]
            self._infer_positional = infer_impl.function  # type: ignore[attr-defined]
        self._infer_with_parameters = plugins.parameters_caller(infer_impl)
        chosen = self.resolution.chosen
        if chosen and chosen.caps.device_tensors and "output_device" in infer_impl.argnames:  # type: ignore[attr-defined]
            self._infer_on_device = infer_impl.function  # type: ignore[attr-defined]
            self._device_tensors = True

    def _fast_call(self) -> tuple[Any, ...] | None:
        """What :meth:`infer` needs for the call every model gets most, all looked up once:
        ``(check_inputs, run, with_device, handle, check_outputs)``; None when this model has no
        such path.

        That call is a dict of numpy arrays that fit the spec, all outputs, numpy out, no
        request parameters: the spec checks compiled for this model (``check_outputs`` None
        when outputs always take the general checks), and the backend's hook as
        ``run(handle, inputs, requested_outputs[, output_device])`` (``with_device``: the
        fourth is passed). Anything the checks do not pass takes the general checks, which say
        what is wrong. It holds no reference to the model (see :meth:`_device_policy`);
        :meth:`close` drops it.
        """
        validator = self._validator
        if not self._run_is_the_hook or validator._fast_inputs is None:
            return None
        positional = self._infer_positional
        run = self._infer if positional is None else positional
        check_outputs = validator._fast_outputs if validator.shared_symbols else None
        return (validator._fast_inputs, run, positional is not None, self._handle, check_outputs)

    def _no_device_tensors(self) -> str:
        """Why this model takes no tensors on a GPU (for messages)."""
        return f"backend {self.backend.id} takes numpy arrays (or CPU tensors) only"

    def _device_policy(self) -> Callable[[str, TensorFacts], str | None]:
        """The validator's ``device_policy`` for this model, once its device and backend are known.

        It holds no reference back to the model: a cycle would leave a dropped model (an OPE
        model's workers too) to the cyclic GC instead of freeing it with its last reference.
        """
        return functools.partial(device_input_problem, self.device, self._device_tensors, self._no_device_tensors())

    def _output_device(self, output_device: str) -> str | None:
        """``output_device`` as the backend gets it: None for numpy outputs, else the model's ``cuda:N``."""
        if not isinstance(output_device, str):
            raise TypeError(f"output_device must be None, 'cpu' or 'cuda[:N]', not {type(output_device).__name__}")
        wanted = parse_device(output_device)
        if wanted == "cpu":
            return None
        if not self._device_tensors:
            raise NeuropodError(f"output_device={output_device!r}: model {self.name!r} cannot leave its outputs on a GPU: "
                                f"{self._no_device_tensors()}")  # fmt: skip
        if self.device == "cpu":
            raise NeuropodError(
                f"output_device={output_device!r}: model {self.name!r} runs on the cpu, so its outputs are numpy arrays. "
                "Load it on a GPU (device='cuda:N') to keep outputs there"
            )
        if output_device.strip().lower() not in ("cuda", "gpu") and wanted != self.device:
            raise NeuropodError(f"output_device={output_device!r}: model {self.name!r} runs on {self.device}, and its "
                                f"outputs stay where it runs; ask for output_device='cuda' or {self.device!r}")  # fmt: skip
        return self.device

    @property
    def name(self) -> str:
        return self.package.name

    @property
    def platform(self) -> str:
        return self.package.platform

    @property
    def inputs(self) -> list[TensorSpec]:
        """The input spec: a new list each time, of entries that are also the original
        Neuropod's dicts (``model.inputs[0]["name"]``, ``model.inputs == [{...}]``)."""
        return list(self.package.config.input_spec)

    @property
    def outputs(self) -> list[TensorSpec]:
        """The output spec, as :attr:`inputs`."""
        return list(self.package.config.output_spec)

    def infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Run the model on one set of inputs.

        :param inputs: input name to tensor: a numpy array (may be
            non-contiguous; string tensors are numpy unicode arrays or object
            arrays of ``str``), or another framework's tensor: a torch tensor,
            or any object with ``__dlpack__`` or ``__cuda_array_interface__``
            (CuPy...). CPU tensors are read without a copy: in this process
            the model gets the caller's own arrays, so a model that edits an
            input in place edits the caller's array (``neuropod serve`` gives
            its models writable arrays on every path, copying read-only
            request buffers). A tensor on the
            GPU the model runs on goes to the framework as it is, with no trip
            through host memory, when the backend takes device tensors
            (TorchScript, ONNX Runtime; in this process); elsewhere it is
            refused with the reason. Spec checks read device tensors'
            dtype and shape from their metadata.
        :param requested_outputs: output names to return (a list; a single
            str is one name); all when None.
        :param output_device: None (or ``"cpu"``): outputs are numpy arrays.
            ``"cuda"`` (or the model's ``"cuda:N"``): numeric outputs stay on
            the model's GPU as the framework's own tensors (``torch.Tensor``,
            onnxruntime ``OrtValue``), which ``torch.from_dlpack``,
            ``cupy.from_dlpack``... take without a copy. String outputs are
            numpy arrays either way. A model on the CPU, in a worker process,
            or whose backend cannot, raises a :class:`NeuropodError` saying so.
        :param parameters: request parameters for the model (a mapping of str to bool, int,
            float or str, as the Open Inference Protocol's request ``parameters``): given to a
            backend whose ``infer`` hook takes ``parameters`` (the python backend passes them on
            to a model function that takes a ``parameters`` keyword); other backends run as
            without them. None or empty: none.
        :returns: output name to numpy array (or device tensor, see ``output_device``).
        :raises TypeError: ``requested_outputs`` is not a list of str.
        :raises SpecError: an input or output does not fit the spec.
        :raises BackendError: the framework failed; its exception is chained.
        """
        fast = self._fast
        if fast is not None and requested_outputs is None and output_device is None and not parameters \
                and type(inputs) is dict:  # fmt: skip
            # The common call, in as few steps as it takes (see _fast_call): the inputs pass the
            # checks compiled for this model as they are, and so do the outputs, or the general
            # checks take them and say what is wrong.
            check_inputs, run, with_device, handle, check_outputs = fast
            bindings = check_inputs(inputs, {})
            if bindings is not None:
                try:
                    outputs = run(handle, inputs, None, None) if with_device else run(handle, inputs, None)
                except NeuropodError:
                    raise
                except Exception as e:
                    raise self._run_failed(e) from e
                if type(outputs) is dict and check_outputs is not None and check_outputs(outputs, bindings) is not None:
                    return outputs
                return self._checked_outputs(outputs, bindings, None, None)
        return self._checked_infer(inputs, requested_outputs, None, output_device, parameters)

    def _checked_infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, call_options: Any,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`infer`, with ``call_options`` for subclasses whose ``infer`` takes more (see :meth:`_run`)."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        validator = self._validator
        if requested_outputs is not None:
            requested_outputs = validator.check_requested(requested_outputs)
        if output_device is not None:
            output_device = self._output_device(output_device)  # None for "cpu"
        if parameters:
            check_parameters(parameters)
        checked, bindings = validator.check_inputs(inputs)
        try:
            if output_device is None:
                if parameters:
                    outputs = self._run_with_parameters(checked, requested_outputs, call_options, parameters)
                elif self._run_is_the_hook:  # the backend's hook, called here: a frame less per call
                    outputs = self._infer(self._handle, checked, requested_outputs)
                else:
                    outputs = self._run(checked, requested_outputs, call_options)
            else:
                outputs = self._infer_on_device(model=self._handle, inputs=checked, requested_outputs=requested_outputs,
                                                output_device=output_device)  # fmt: skip
        except NeuropodError:
            raise
        except Exception as e:
            raise self._run_failed(e) from e
        return self._checked_outputs(outputs, bindings, requested_outputs, output_device)

    def _run_failed(self, e: Exception) -> BackendError:
        """The error for a framework's exception while running the model (the caller chains ``e``)."""
        return BackendError(f"Backend {self.backend.id} failed to run model {self.name!r}: {_framework_error(e)}")

    def _checked_outputs(
        self, outputs: Any, bindings: dict[str, tuple[int, str]], requested_outputs: list[str] | None,
        output_device: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        """What the backend returned, as a dict checked against the output spec."""
        if type(outputs) is not dict and not isinstance(outputs, Mapping):
            raise BackendError(
                f"Backend {self.backend.id} returned {type(outputs).__name__} for model {self.name!r}, "
                "not a dict of output name to numpy array"
            )
        checked: dict[str, Any] = outputs if type(outputs) is dict else dict(outputs)
        self._validator.check_outputs(checked, bindings, requested_outputs, output_device is not None)
        return checked

    def _run(self, inputs: dict[str, np.ndarray], requested_outputs: list[str] | None, call_options: Any) -> Any:
        """Run the checked inputs: the backend's ``infer`` hook (bound once, see :meth:`_bind_infer`)."""
        return self._infer(self._handle, inputs, requested_outputs)

    def _run_with_parameters(
        self, inputs: dict[str, np.ndarray], requested_outputs: list[str] | None, call_options: Any,
        parameters: Mapping[str, Any],
    ) -> Any:  # fmt: skip
        """:meth:`_run` for a call with request parameters: the backend's hook gets them when it
        takes them (in this process, or in a worker: see :class:`~neuropod.ope.WorkerModel`);
        otherwise the model runs as without them, as Triton's backends ignore parameters they
        do not read."""
        if self._run_is_the_hook and self._infer_with_parameters is not None:
            return self._infer_with_parameters(self._handle, inputs, requested_outputs, parameters)
        return self._run(inputs, requested_outputs, call_options)

    def close(self) -> None:
        """Free the backend's resources; later calls to infer fail."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._fast = None  # later calls take _checked_infer, which says the model is closed
            handle, self._handle = self._handle, None
        closer = getattr(handle, "close", None)
        if callable(closer):
            closer()

    def __enter__(self) -> NeuropodModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.backend.id} on {self.device}"
        return f"<NeuropodModel {self.name!r} ({self.platform}) {state}>"


def device_input_problem(model_device: str, accepts: bool, refusal: str, name: str, facts: TensorFacts) -> str | None:
    """Why input ``name``, a tensor on a GPU, cannot go as it is to a model on ``model_device`` (None: it can).

    A :class:`~neuropod.spec.SpecValidator`'s ``device_policy``, with the first three arguments bound:
    whether the model takes device tensors at all, and what to say when it does not.
    """
    if not accepts:
        return refusal
    if model_device == "cpu":
        return "the model runs on the cpu. Pass a numpy array (or a CPU tensor), or load the model on that GPU (device='cuda:N')"
    if facts.device != "cuda" and facts.device != model_device:
        return f"the model runs on {model_device}; move the tensor there first (no copy between GPUs is made for you)"
    return None


def _framework_error(e: BaseException) -> str:
    """A framework's exception as text: its last line first (frameworks such as
    TorchScript put the actual error under a long trace of the model's code),
    then the whole message."""
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return f"{type(e).__name__}: {text}"
    return f"{lines[-1].strip()}\n{type(e).__name__} from the framework:\n{text}"


def _host(host: Host | str | os.PathLike[str] | None) -> Host:
    if host is None:
        return local_host()
    if isinstance(host, Host):
        return host
    return load_host(host)


# --- argument checks: wrong types and values fail before any file is read ---


def _check_path(name: str, value: object, *, package_ok: bool) -> None:
    if isinstance(value, (str, os.PathLike)) or (package_ok and isinstance(value, Package)):
        return
    expected = "a path (str or os.PathLike)" + (" or a Package" if package_ok else "")
    raise TypeError(f"{name} must be {expected}, not {type(value).__name__} {value!r:.60}")


def _check_resolution_args(device: object, backend: object, host: object = None) -> None:
    """``device``, ``backend`` and ``host`` as :func:`plan` and :func:`load_neuropod` take them."""
    if device is not None:
        if not isinstance(device, str):
            raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', or None, not {type(device).__name__} {device!r:.60}")
        parse_device(device)  # an unknown device is a NeuropodError naming the accepted forms
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(
                f"backend must be a str such as 'onnx' or 'onnx==1.31.1', or None, not {type(backend).__name__} {backend!r:.60}"
            )
        parse_backend_pin(backend)
    if host is not None and not isinstance(host, Host):
        _check_path("host", host, package_ok=False)


def _check_tolerance(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} {value!r:.60}")
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")


def plan(
    package: Package | str | os.PathLike[str],
    *,
    device: str | None = None,
    backend: str | None = None,
    host: Host | str | os.PathLike[str] | None = None,
) -> Resolution:
    """Resolve a package against the installed backends without loading it.

    :param host: the machine to plan for: a :class:`Host`, a host file, or
        None for this machine. A host file that lists ``backends`` is planned
        with those; otherwise with this environment's installed backends and
        those of the backend environments (:mod:`neuropod.envs`); an
        in-process backend wins over an environment's when both fit.
    """
    from neuropod.envs import environment_backends

    _check_path("package", package, package_ok=True)
    _check_resolution_args(device, backend, host)
    pkg = package if isinstance(package, Package) else read_package(package)
    target = _host(host)
    if target.backends:  # a described machine with its own software
        caps = dict(target.backends)
        backends = list(caps)
    else:
        backends = plugins.installed_backends()
        caps = {b: plugins.backend_caps(b) for b in backends}
        for b, c in environment_backends():
            backends.append(b)
            caps[b] = c
    return resolve(pkg.config, backends, caps, target, device=device, backend=backend)


def load_neuropod(
    neuropod_path: str | os.PathLike[str] | Package | Sequence[str],
    *,
    device: str | None = None,
    backend: str | None = None,
    verify: bool = True,
    use_ope: bool = False,
    workers: int = 1,
    restart: bool = False,
    timeout: float | None = None,
    **load_options: Any,
) -> NeuropodModel:
    """Load a package with the best backend installed here.

    :param neuropod_path: a package directory or zip (or a :class:`Package` already read),
        the URL of one in an object store or on a web server (``s3://bucket/adder.neuropod``,
        a directory prefix ``s3://bucket/models/adder/``, ``gs://``, ``az://``, ``abfs://``,
        or an ``https://`` URL ending in ``.zip`` or ``.neuropod``: downloaded once per
        version of the object into the cache, see :mod:`neuropod.storage`; needs the
        core's extra for the store, e.g. ``pip install 'neuropod[s3]'``),
        or the URL of a model on an Open Inference Protocol server
        (``grpc://host:8001/model``, ``http://``, ``https://``, ``grpcs://``;
        a list of URLs spreads calls over several servers). Remote models need
        ``pip install 'neuropod-serving[client]'`` and take its options
        (``timeout``, ``retries``, ``auth_token``, ``tls``, ``ca_cert``...;
        see :func:`neuropod_serving.client.load`), not ``device``, ``backend``
        or the OPE options.
    :param device: ``"cpu"`` or ``"cuda:N"`` to force a device; by default a
        GPU when the model asks for one and one fits, else the CPU.
    :param backend: pin a backend, e.g. ``"onnx"`` or ``"onnx==1.31.1"``.
    :param verify: check the files against the package's manifest.
    :param use_ope: run the model in worker process(es) (out-of-process
        execution; see :mod:`neuropod.ope`). Models whose backend lives in a
        backend environment always do.
    :param workers: with OPE, how many worker processes share the calls.
    :param restart: with OPE, start a new worker on the next call after one died.
    :param timeout: with OPE, seconds each call may take: a worker that has
        not answered by then is killed and the call raises ``WorkerError``;
        with ``restart=True`` the next call starts a new worker (after checking
        the package is unchanged), else later calls raise. Loading is not
        bounded by it. None: wait as long as the model runs.
    :param load_options: ``storage_options`` (for a package URL: the fsspec filesystem's
        options, such as credentials or ``client_kwargs={"endpoint_url": ...}``); the rest are
        passed to the backend's ``load_model`` hook
        (for example thread counts); backends reject options they do not know.
        Two options of the original Neuropod are taken here: ``visible_gpu=N``
        (``device="cuda:N"``; ``None`` for the CPU) and ``load_custom_ops=False``
        (the caller has loaded the package's op libraries itself; in-process
        only, since a worker process starts without them).
    :raises TypeError, ValueError: an argument of the wrong type or value
        (raised before the package is read).
    :raises PackageError: the package is missing, malformed or changed.
    :raises NoBackendError: nothing here can run it; the message has the table.
    :raises BackendError: the framework failed to load the model.
    """
    from neuropod import remote, storage

    storage_options = load_options.pop("storage_options", None)
    url = None
    if storage.is_package_url(neuropod_path):
        url = neuropod_path
        neuropod_path = storage.fetch(url, storage_options=storage_options)  # type: ignore[arg-type]
    elif storage_options is not None:
        raise ValueError(
            "storage_options applies to package URLs (s3://, gs://, az://, abfs://, or an http(s) URL of a .zip or "
            f".neuropod file), not to {neuropod_path!r:.100}"
        )
    if remote.is_remote(neuropod_path):
        return remote.load_remote(
            neuropod_path,  # type: ignore[arg-type]
            device=device, backend=backend, verify=verify, use_ope=use_ope, workers=workers, restart=restart,
            timeout=timeout, **load_options,
        )  # fmt: skip
    device = _original_load_options(load_options, device)
    load_custom_ops = load_options.pop("load_custom_ops", True)
    check_flag("load_custom_ops", load_custom_ops)
    _check_load_args(neuropod_path, device=device, backend=backend, verify=verify, use_ope=use_ope,
                     workers=workers, restart=restart, timeout=timeout)  # fmt: skip
    try:
        package = neuropod_path if isinstance(neuropod_path, Package) else read_package(neuropod_path, verify=verify)  # type: ignore[arg-type]  # a list is remote, above
    except PackageError as e:
        if url is None:
            raise
        raise storage.as_downloaded(e, neuropod_path, url) from None  # type: ignore[arg-type]
    resolution = plan(package, device=device, backend=backend)
    chosen = resolution.raise_if_unresolved()
    if use_ope or chosen.backend.location != "in-process" or package.requirements_lock is not None:
        return _load_in_workers(package, resolution, load_options, workers=workers, restart=restart, timeout=timeout)
    load = plugins.bound_hook("load_model", chosen.backend)
    in_process = package
    if not load_custom_ops and package.config.custom_ops:
        # The caller has loaded the package's op libraries itself (the original's load_custom_ops=False).
        in_process = replace(package, config=replace(package.config, custom_ops=()))
    try:
        handle = load(package=in_process, backend=chosen.backend, device=chosen.device, options=dict(load_options))
    except InProcessConflictError as e:
        warnings.warn(f"{e}. Model {package.name!r} runs in a worker process instead (OPE).", UserWarning, stacklevel=2)
        return _load_in_workers(package, resolution, load_options, workers=workers, restart=restart, timeout=timeout)
    except NeuropodError:
        raise
    except Exception as e:
        raise BackendError(
            f"Backend {chosen.backend.id} failed to load model {package.name!r} from {package.source}: "
            f"{_framework_error(e)}"
        ) from e
    if handle is None:
        raise BackendError(f"Plugin {chosen.backend.plugin!r} did not load model {package.name!r}")
    return NeuropodModel(package, resolution, handle)


_LOAD_ARGS = ("device", "backend", "use_ope", "workers", "restart", "timeout")


def _original_load_options(options: dict[str, Any], device: str | None) -> str | None:
    """Take the original Neuropod's ``visible_gpu`` out of ``options``: the device it means.

    ``visible_gpu=None`` is the CPU. ``visible_gpu=N`` is ``device="cuda:N"``
    on a host that has that GPU; on one that does not, the original ran the
    model on the CPU (``visible_gpu=0`` was its default), so it means "no
    preference" there and resolution picks the device as usual.
    """
    if "visible_gpu" not in options:
        return device
    gpu = options.pop("visible_gpu")
    if device is not None:
        raise ValueError(f"give device= or visible_gpu= (the original Neuropod's form), not both (device={device!r}, visible_gpu={gpu!r})")
    if gpu is None:
        return "cpu"
    if isinstance(gpu, bool) or not isinstance(gpu, numbers.Integral) or gpu < 0:
        raise ValueError(f"visible_gpu must be a GPU index (an int >= 0) or None for the CPU, not {gpu!r:.60}")
    wanted = f"cuda:{int(gpu)}"
    return wanted if wanted in local_host().devices else None


def _check_load_args(
    neuropod_path: object, *, device: object = None, backend: object = None, verify: object = True,
    use_ope: object = False, workers: object = 1, restart: object = False, timeout: object = None,
) -> None:  # fmt: skip
    _check_path("neuropod_path", neuropod_path, package_ok=True)
    _check_resolution_args(device, backend)
    for name, flag in (("verify", verify), ("use_ope", use_ope), ("restart", restart)):
        check_flag(name, flag)
    check_workers(workers)
    check_seconds("timeout", timeout)


def _load_in_workers(
    package: Package, resolution: Resolution, options: Mapping[str, Any], *, workers: int, restart: bool,
    timeout: float | None,
) -> NeuropodModel:  # fmt: skip
    from neuropod.ope import start_pool
    from neuropod.ope._model import WorkerModel, options_for_worker

    chosen = resolution.raise_if_unresolved()
    backend = chosen.backend
    python = sys.executable
    lock = package.requirements_lock
    if lock is not None or backend.location.startswith("python:"):
        resolution, python = _lock_environment(package, resolution, lock or "")
        chosen = resolution.raise_if_unresolved()
        backend = chosen.backend
    elif backend.location.startswith("env:"):
        from neuropod.envs import get_environment

        python = str(get_environment(backend.location[4:]).python)
    gpu_uuid = None
    if chosen.device and chosen.device.startswith("cuda"):
        gpu_uuid = resolution.host.gpu(chosen.device).uuid
    pool = start_pool(
        package.name, python, str(package.root), backend.id, chosen.device or "cpu", options_for_worker(options),
        workers=workers, restart=restart, timeout=timeout, gpu_uuid=gpu_uuid, package=package,
    )  # fmt: skip
    return WorkerModel(package, resolution, pool)


def _lock_environment(package: Package, resolution: Resolution, lock: str) -> tuple[Resolution, str]:
    """The lock environment for the package (built on first use), and the resolution with its backend.

    A package with ``0/requirements.lock``, or one whose backend is another
    interpreter (``python:<path>``), runs in a worker from an environment
    built from the lock (empty for the latter) on the chosen backend's
    interpreter. The model then reports that environment's backend.
    """
    from neuropod.envs import lock_environment

    chosen = resolution.raise_if_unresolved()
    env = lock_environment(lock, chosen.backend, package_name=package.name, package_source=str(package.source))
    found = [(b, c) for b, c in env.backends if b.platform == chosen.backend.platform]
    if not found:
        raise BackendError(
            f"The lock environment {env.name} ({env.path}) offers no {chosen.backend.platform!r} backend; "
            f"it offers: {', '.join(b.id for b, _ in env.backends) or 'none'}"
        )
    backend, caps = found[0]
    swapped = replace(chosen, backend=backend, caps=caps)
    candidates = tuple(swapped if c is chosen else c for c in resolution.candidates)
    return replace(resolution, candidates=candidates, chosen=swapped), str(env.python)


@dataclass(frozen=True)
class TestReport:
    """The outcome of running a package's bundled test data."""

    model: str
    backend: str
    device: str
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray] | None
    mismatches: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.mismatches


def compare_outputs(
    outputs: Mapping[str, np.ndarray], expected: Mapping[str, Any], *, rtol: float = 1e-5, atol: float = 1e-6
) -> list[str]:
    """Describe every way ``outputs`` differ from ``expected`` (empty when they match)."""
    problems = []
    for name, want in expected.items():
        if name not in outputs:
            problems.append(f"output {name!r} is missing")
            continue
        got, want = np.asarray(outputs[name]), np.asarray(want)
        if got.shape != want.shape:
            problems.append(f"output {name!r} has shape {got.shape}, expected {want.shape}")
        elif got.dtype.kind in "UOS" or want.dtype.kind in "UOS":
            if got.astype(str).tolist() != want.astype(str).tolist():
                problems.append(f"output {name!r} is {got.tolist()!r:.200}, expected {want.tolist()!r:.200}")
        elif not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            diff = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))
            problems.append(f"output {name!r} differs from the expected values (max abs difference {diff:.3g})")
    return problems


def run_test_data(
    neuropod_path: str | os.PathLike[str] | Package,
    *,
    trust_pickle: bool = False,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **load_kwargs: Any,
) -> TestReport:
    """Load a package (a path, or a :class:`Package` already read), run its bundled test inputs and
    compare with the expected outputs."""
    verify = load_kwargs.pop("verify", True)
    check_flag("trust_pickle", trust_pickle)
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)
    _check_load_args(neuropod_path, verify=verify, **{k: v for k, v in load_kwargs.items() if k in _LOAD_ARGS})
    package = neuropod_path if isinstance(neuropod_path, Package) else read_package(neuropod_path, verify=verify)
    # Read the test data first: a refused pickle should not wait for a backend.
    inputs, expected = package.test_data(trust_pickle=trust_pickle)
    return _run_and_compare(package, inputs, expected, rtol=rtol, atol=atol, load_kwargs=load_kwargs)


def _run_and_compare(
    package: Package, inputs: Mapping[str, Any], expected: Mapping[str, Any] | None, *, rtol: float, atol: float,
    load_kwargs: Mapping[str, Any],
) -> TestReport:  # fmt: skip
    with load_neuropod(package, **load_kwargs) as model:
        outputs = model.infer(inputs)
        mismatches = compare_outputs(outputs, expected, rtol=rtol, atol=atol) if expected is not None else []
        return TestReport(
            model.name, model.backend.id, model.device, dict(inputs), outputs,
            None if expected is None else dict(expected), tuple(mismatches),
        )  # fmt: skip


def check_packaged(
    neuropod_path: str | os.PathLike[str],
    *,
    test_input_data: Mapping[str, Any] | None = None,
    test_expected_out: Mapping[str, Any] | None = None,
    neuropod_load_args: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> TestReport | None:
    """For packagers: load a new package once and run its test data.

    The test data is the package's own (what ``persist_test_data`` stored),
    else ``test_input_data`` / ``test_expected_out`` as given. With inputs,
    the model runs once on them; with expected outputs too, its outputs must
    match. A package that cannot load (say, a spec that does not fit the
    model), fails on its test inputs or does not reproduce its expected
    outputs is removed, so nobody deploys it by mistake, and the error is
    raised: the loader's or the model's own (a :class:`SpecError`,
    :class:`BackendError`, ...), or a :class:`PackageError` (also a
    ``ValueError``, as the original Neuropod raised) for outputs that differ
    from the expected ones. Without expected outputs, a package that no backend here can
    run (made for another framework version) is kept with a warning that it
    was not checked.

    :param neuropod_load_args: more keywords for :func:`load_neuropod` (the
        original Neuropod's packager keyword), e.g. ``{"visible_gpu": None}``.
    :param kwargs: for :func:`load_neuropod` (e.g. ``backend=``), plus
        ``rtol``/``atol`` for the comparison.
    :returns: the test report, or None when nothing was run.
    """
    rtol, atol = kwargs.pop("rtol", 1e-5), kwargs.pop("atol", 1e-6)
    if neuropod_load_args is not None:
        if not isinstance(neuropod_load_args, Mapping):
            raise TypeError(f"neuropod_load_args must be a dict of load_neuropod keywords, not {type(neuropod_load_args).__name__}")
        kwargs.update(neuropod_load_args)
    try:
        package = read_package(neuropod_path)
        inputs: Mapping[str, Any] | None = test_input_data
        expected: Mapping[str, Any] | None = test_expected_out if test_input_data is not None else None
        if package.has_test_data:
            inputs, expected = package.test_data()
        if expected is None:
            resolution = plan(package, device=kwargs.get("device"), backend=kwargs.get("backend"))
            if resolution.chosen is None:
                # Packaging for a framework version this machine does not have is
                # legitimate; say that the package was not tried rather than fail.
                warnings.warn(
                    f"Package {package.source} was not checked by loading it: no installed backend can run it "
                    f"here ({resolution.advice()})",
                    UserWarning,
                    stacklevel=3,
                )
                return None
        if inputs is None:
            load_neuropod(package, **kwargs).close()
            return None
        report = _run_and_compare(package, inputs, expected, rtol=rtol, atol=atol, load_kwargs=kwargs)
        if not report.passed:
            raise PackageError(
                f"The new package for model {report.model!r} does not reproduce its expected test output "
                f"with {report.backend} on {report.device}: " + "; ".join(report.mismatches)
                + ". The package was not kept."
            )
        return report
    except BaseException:
        _remove(Path(neuropod_path))
        raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


__all__ = ["NeuropodModel", "TestReport", "check_packaged", "compare_outputs", "load_neuropod", "plan", "run_test_data"]
