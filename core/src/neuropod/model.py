"""The loaded model: :class:`NeuropodModel`, what ``load_neuropod`` returns (see :mod:`neuropod.loader`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from neuropod import plugins
from neuropod._args import check_parameters
from neuropod.backend import Backend
from neuropod.devices import parse_device
from neuropod.errors import BackendError, NeuropodError, NoBackendError, SequenceError
from neuropod.package import Package
from neuropod.resolve import Resolution
from neuropod.sequences import NOT_FAST
from neuropod.spec import SpecValidator, TensorSpec
from neuropod.stateful import StatefulModel, caller_specs
from neuropod.streams import AsyncResponseStream, ResponseStream, cannot_stream
from neuropod.tensors import TensorFacts


class NeuropodModel(StatefulModel):
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
        self._sequences, self._inputs, self._outputs = caller_specs(package)
        self._validator = SpecValidator(
            package.name, self._inputs, self._outputs, shared_symbols=not package.original_format,
        )  # fmt: skip
        self._bind_infer()
        #: ``call(handle, inputs, requested_outputs, parameters)`` -> the backend's iterator of
        #: responses, for a decoupled model (see :meth:`infer_stream`); None for others.
        self._stream: Callable[[Any, Any, Any, Any], Any] | None = None
        if self.decoupled:
            try:
                self._stream = self._bind_stream()
            except BaseException:
                closer = getattr(handle, "close", None)  # the backend loaded it: free it before refusing
                if callable(closer):
                    closer()
                raise
        # Subclasses that run the model elsewhere (a worker, a server) override _run.
        self._run_is_the_hook = type(self)._run is NeuropodModel._run
        self._validator.device_policy = self._device_policy()
        self._closed = False
        self._fast = None if self.decoupled or self._sequences is not None else self._fast_call()
        self._fast_step = self._fast_step_call()
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

    def _bind_stream(self) -> Callable[[Any, Any, Any, Any], Any]:
        """The backend's ``infer_stream`` hook, for a decoupled model; a NeuropodError when its
        plugin has none (the model cannot run there)."""
        try:
            impl = plugins.bound_hook("infer_stream", self.backend)
        except NoBackendError:
            raise cannot_stream(self.name, self.backend) from None
        return plugins.stream_caller(impl)

    @property
    def decoupled(self) -> bool:
        """Whether the model answers a request with any number of responses (zero or more): run
        it with :meth:`infer_stream` (its :meth:`infer` refuses)."""
        return self.package.config.decoupled

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
        if not self._run_is_the_hook or self._validator._fast_inputs is None:
            return None
        return self._fast_call_unchecked()

    def _fast_call_unchecked(self) -> tuple[Any, ...]:
        validator = self._validator
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
        Neuropod's dicts (``model.inputs[0]["name"]``, ``model.inputs == [{...}]``). A stateful
        model's state and control inputs are not in it: the runtime fills them."""
        return list(self._inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        """The output spec, as :attr:`inputs` (a stateful model's state outputs are not in it)."""
        return list(self._outputs)

    def infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
        sequence_id: int | str | None = None, sequence_start: bool = False, sequence_end: bool = False,
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
        :param sequence_id: for a stateful model (:attr:`stateful`), the sequence this request
            is a step of (an int >= 1 or a non-empty str; :meth:`sequence` manages one for you):
            its state goes in, the new state is kept for its next step. A stateful model needs
            one; other models refuse one.
        :param sequence_start: this is the sequence's first step: it starts from the initial
            state (a live sequence of that id restarts).
        :param sequence_end: this is its last step: its state is freed after it.
        :returns: output name to numpy array (or device tensor, see ``output_device``).
        :raises TypeError: ``requested_outputs`` is not a list of str.
        :raises SpecError: an input or output does not fit the spec.
        :raises BackendError: the framework failed; its exception is chained.
        :raises SequenceError: a sequence that is not live without ``sequence_start``, a stateful
            model without ``sequence_id`` or another model with one.
        """
        fast = self._fast
        if fast is not None and requested_outputs is None and output_device is None and not parameters \
                and sequence_id is None and type(inputs) is dict:  # fmt: skip
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
        if sequence_id is not None and sequence_start is False and self._fast_step is not None:
            fast_step = self._fast_step
            if requested_outputs is None and output_device is None and not parameters and type(inputs) is dict \
                    and type(sequence_end) is bool and (type(sequence_id) is int or type(sequence_id) is str):  # fmt: skip
                # A live sequence's next step, in as few steps as it takes (see SequenceTable.run_one).
                check_inputs, table, run, with_device, handle, check_outputs, rows = fast_step
                bindings = check_inputs(inputs, {})
                if bindings is not None and (rows is None or bindings.get(rows[0], (rows[1],))[0] == rows[1]):
                    try:
                        outputs = table.run_one(sequence_id, sequence_end, inputs, run, handle, with_device)
                    except NeuropodError:
                        raise
                    except Exception as e:
                        raise self._run_failed(e) from e
                    if outputs is not NOT_FAST:
                        if type(outputs) is dict and check_outputs is not None and check_outputs(outputs, bindings) is not None:
                            return outputs
                        return self._checked_outputs(outputs, bindings, None, None)
        if sequence_id is not None or self._sequences is not None:
            return self._infer_step(
                inputs, requested_outputs, output_device, parameters, sequence_id, sequence_start, sequence_end
            )
        return self._checked_infer(inputs, requested_outputs, None, output_device, parameters)

    def _checked_infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, call_options: Any,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`infer`, with ``call_options`` for subclasses whose ``infer`` takes more (see :meth:`_run`)."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if self._sequences is not None:
            return self._infer_step(inputs, requested_outputs, output_device, parameters, None, False, False)
        if self._stream is not None:
            raise NeuropodError(
                f"Model {self.name!r} is decoupled: it answers a request with any number of responses, so it "
                "runs with infer_stream(inputs), which returns them as they come, not with infer"
            )
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

    def infer_stream(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
        parameters: Mapping[str, Any] | None = None,
    ) -> ResponseStream:  # fmt: skip
        """Run the model on one set of inputs and return its responses as they come.

        A decoupled model (:attr:`decoupled`) answers with zero or more responses, each a dict
        holding some or all of its outputs; any other model with exactly one, its :meth:`infer`
        answer. Iterate the stream; stop early with ``close()`` (or leave a ``with`` block),
        which closes the model's generator so its ``finally`` runs. Inputs are checked now; each
        response is checked against the output spec as it comes (outputs missing from a
        response are allowed, those present must fit).

        :param inputs: input name to tensor, as for :meth:`infer` (CPU tensors only).
        :param requested_outputs: output names to return; a response keeps only these (one
            that holds none of them is still handed out, empty). All when None.
        :param parameters: request parameters for the model, as for :meth:`infer`.
        :returns: a :class:`~neuropod.streams.ResponseStream`, an iterator of output dicts.
        :raises SpecError: an input does not fit the spec (here); a response that does not fit
            ends the stream with it (from ``next``), after the responses before it.
        :raises BackendError: the model failed (from ``next``, after the responses it made).
        """
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if self._sequences is not None:
            raise SequenceError(
                f"model {self.name!r} is stateful: it answers each step of a sequence once; run it with "
                "model.sequence() or infer(..., sequence_id=...), not infer_stream"
            )
        validator = self._validator
        requested = None if requested_outputs is None else validator.check_requested(requested_outputs)
        if parameters:
            check_parameters(parameters)
        checked, bindings = validator.check_inputs(inputs)
        if self._stream is None:
            return ResponseStream(
                self._one_response(checked, bindings, requested, parameters), _as_checked, self._run_failed
            )
        try:
            source = self._stream(self._handle, checked, requested, parameters or None)
        except NeuropodError:
            raise
        except Exception as e:
            raise self._run_failed(e) from e
        if source is None or isinstance(source, Mapping) or not hasattr(source, "__next__"):
            source = iter(_not_an_iterator(self, source))
        return ResponseStream(source, functools.partial(self._checked_response, bindings, requested), self._run_failed)

    def ainfer_stream(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None, *,
        parameters: Mapping[str, Any] | None = None,
    ) -> AsyncResponseStream:  # fmt: skip
        """:meth:`infer_stream` for asyncio code: ``async for response in model.ainfer_stream(inputs)``.

        The same checks (inputs now, each response as it comes) and errors; each response is
        read on a thread of the event loop's default executor, so the loop does not wait for
        the model. Close it with ``await stream.aclose()`` or ``async with``.

        :returns: a :class:`~neuropod.streams.AsyncResponseStream`.
        """
        return AsyncResponseStream(self.infer_stream(inputs, requested_outputs, parameters=parameters))

    def _one_response(
        self, inputs: dict[str, Any], bindings: dict[str, tuple[int, str]], requested: list[str] | None,
        parameters: Mapping[str, Any] | None,
    ) -> Any:  # fmt: skip
        """An ordinary model's one answer, as a stream's only response (run when it is read; the
        stream turns a framework's exception into :meth:`_run_failed`'s error, as :meth:`infer` does)."""
        if parameters:
            outputs = self._run_with_parameters(inputs, requested, None, parameters)
        else:
            outputs = self._run(inputs, requested, None)
        yield self._checked_outputs(outputs, bindings, requested, None)

    def _checked_response(
        self, bindings: dict[str, tuple[int, str]], requested: list[str] | None, outputs: Any
    ) -> dict[str, Any]:
        """One response of a decoupled model, as it is handed out: a dict of the requested
        outputs it holds, each checked against the spec (symbols bound by the inputs hold;
        those the outputs bind are bound afresh in each response)."""
        if type(outputs) is not dict:
            if not isinstance(outputs, Mapping):
                raise BackendError(
                    f"Backend {self.backend.id} gave a response of {type(outputs).__name__} for model "
                    f"{self.name!r}, not a dict of output name to numpy array"
                )
            outputs = dict(outputs)
        checked: dict[str, Any] = outputs if requested is None else {k: outputs[k] for k in requested if k in outputs}
        self._validator.check_outputs(checked, dict(bindings), None, False, partial=True)
        return checked

    def _run_failed(self, e: Exception) -> BackendError:
        """The error for a framework's exception while running the model (the caller chains ``e``)."""
        return BackendError(f"Backend {self.backend.id} failed to run model {self.name!r}: {framework_error(e)}")

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
        takes them (in this process, or in a worker: see :class:`~neuropod.ope.worker_model.WorkerModel`);
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
            self._fast_step = None
            handle, self._handle = self._handle, None
        if self._sequences is not None:
            self._sequences.clear()
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


def _as_checked(outputs: dict[str, Any]) -> dict[str, Any]:
    return outputs


def _not_an_iterator(model: NeuropodModel, value: Any) -> Any:
    """A decoupled model's backend returned something other than an iterator of responses."""
    error = BackendError(
        f"Backend {model.backend.id} returned {type(value).__name__} from infer_stream for decoupled model "
        f"{model.name!r}, not an iterator of responses"
    )
    yield from ()  # a generator: the error comes from the stream's first next()
    raise error


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


def framework_error(e: BaseException) -> str:
    """A framework's exception as text: its last line first (frameworks such as
    TorchScript put the actual error under a long trace of the model's code),
    then the whole message."""
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) <= 1:
        return f"{type(e).__name__}: {text}"
    return f"{lines[-1].strip()}\n{type(e).__name__} from the framework:\n{text}"


__all__ = ["NeuropodModel", "device_input_problem", "framework_error"]
