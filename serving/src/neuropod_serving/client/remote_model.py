"""The remote model: a :class:`~neuropod.model.NeuropodModel` whose runs go to Open Inference Protocol servers."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from neuropod._args import check_flag, check_parameters, check_seconds
from neuropod.backend import Backend
from neuropod.errors import NeuropodError, RemoteError, SequenceError, SpecError
from neuropod.model import NeuropodModel
from neuropod.sequences import Sequence as ModelSequence
from neuropod.sequences import SequenceStep, check_sequence_id
from neuropod.spec import SpecValidator, TensorSpec
from neuropod.stateful import check_rows, check_steps
from neuropod.storage.urls import redact
from neuropod.streams import ResponseStream
from neuropod_serving import __version__
from neuropod_serving.client._errors import RemoteSequenceError, remote_error, sequence_error
from neuropod_serving.client._pool import Pool, Server, Transport
from neuropod_serving.client._target import Target
from neuropod_serving.client.remote_stream import RemoteResponseStream, StreamSource, one_answer, requested_only

#: Seconds that loading (metadata and readiness calls) may take per server.
CONNECT_TIMEOUT_S = 10.0
#: Model-level metadata parameters a neuropod server sends (REST ``parameters``;
#: gRPC carries them in the ``neuropod-shapes`` trailer).
BACKEND_PARAMETER = "neuropod_backend"
DEVICE_PARAMETER = "neuropod_device"
#: ``"separate"`` for a package the original Neuropod wrote: spec symbols are bound within the
#: inputs and within the outputs, not across both (see :class:`neuropod.spec.SpecValidator`).
SYMBOLS_PARAMETER = "neuropod_symbols"
#: True for a decoupled model (any number of responses a request: see :attr:`RemoteModel.decoupled`).
DECOUPLED_PARAMETER = "neuropod_decoupled"
#: True for a stateful model (it runs in sequences: see :attr:`RemoteModel.stateful`).
STATEFUL_PARAMETER = "neuropod_stateful"
#: The request parameters of Triton's sequence extension.
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


class RemoteBackend(Backend):
    """The backend of a remote model: what the server says runs it, and where.

    ``location`` is ``"remote: grpc://host:port"`` (several servers: comma-separated);
    ``id`` is the server's backend (``onnx==1.31.1``) when it says, else the
    model's platform. The model's ``device`` is the server's (``"cpu"``,
    ``"cuda:0"``) when it says, else ``"remote"``.
    """

    @property
    def id(self) -> str:
        return f"{self.platform}=={self.version}" if self.version else self.platform


class RemoteModel(NeuropodModel):
    """A model served by one or more Open Inference Protocol servers.

    The same ``infer``, ``infer_stream``, ``decoupled``, ``inputs``, ``outputs``, ``name``,
    ``close()`` and context manager as a local model, and thread-safe. Extra: ``infer(...,
    timeout=)`` and ``infer_stream(..., timeout=)`` for one call, :attr:`urls`, :meth:`status`.

    Outputs are numpy arrays over the received message (no copy): from gRPC
    they are read-only (copy one to change it); from REST, writable.
    ``package`` and ``resolution`` are None: the server has the package.
    """

    def __init__(
        self,
        targets: list[Target],
        pool: Pool,
        metadata: Mapping[str, Any],
        spec: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]],
        *,
        timeout: float | None,
        decoupled: bool | None = None,
        stateful: bool | None = None,
    ):
        inputs, outputs = spec
        self._decoupled = decoupled
        self._stateful = stateful
        #: The server each sequence this model started lives on (several servers only): its
        #: state is there, so its later steps go there and nowhere else.
        self._homes: dict[int | str, Server] = {}
        self._homes_lock = threading.Lock()
        self.package = None  # type: ignore[assignment]
        self.resolution = None  # type: ignore[assignment]
        self.urls: tuple[str, ...] = tuple(t.url for t in targets)
        self._targets = targets
        self._pool = pool
        self._timeout = timeout
        self._name = str(metadata.get("name") or targets[0].model)
        self._platform = str(metadata.get("platform") or "")
        self._inputs: tuple[TensorSpec, ...] = inputs
        self._outputs: tuple[TensorSpec, ...] = outputs
        params = metadata.get("parameters")
        self._server_params: dict[str, Any] = dict(params) if isinstance(params, Mapping) else {}
        where = "remote: " + ", ".join(dict.fromkeys(t.server for t in targets))
        platform, _, version = str(self._server_params.get(BACKEND_PARAMETER, "")).partition("==")
        self.backend = RemoteBackend(
            platform=platform or self._platform or "remote",
            version=version,
            framework="",
            plugin="remote",
            plugin_distribution=f"neuropod-serving {__version__}",
            location=where,
        )
        # The server's device ("cpu", "cuda:0") when it says (a neuropod server does), so that code
        # that asks `model.device` works alike for local and remote models; "remote" otherwise.
        self.device = str(self._server_params.get(DEVICE_PARAMETER) or "remote")
        self._handle = pool
        shared = self._server_params.get(SYMBOLS_PARAMETER) != "separate"
        self._validator = SpecValidator(self._name, inputs, outputs, shared_symbols=shared)
        self._validator.device_policy = self._device_policy()
        self._all_outputs = [s.name for s in outputs] or None
        self._bind_infer()
        self._stream = None  # infer_stream sends the call itself (see RemoteModel.infer_stream)
        self._closed = False
        self._close_lock = threading.Lock()

    def _bind_infer(self) -> None:
        pass  # _run sends the call; there is no plugin hook to bind

    def _no_device_tensors(self) -> str:
        return "a remote model's tensors travel to the server from host memory; pass numpy arrays (or CPU tensors)"

    @property
    def decoupled(self) -> bool:
        """Whether the model answers a request with any number of responses (zero or more), as
        the server says (``neuropod serve`` with the model metadata parameter
        ``neuropod_decoupled``; Triton in the model's configuration, its
        ``model_transaction_policy``): run it with :meth:`infer_stream` (its :meth:`infer`
        refuses). False for a model of a server that does not say."""
        if self._decoupled is not None:
            return self._decoupled
        flag = self._server_params.get(DECOUPLED_PARAMETER)
        return flag is True or (isinstance(flag, str) and flag.lower() == "true")

    @property
    def stateful(self) -> bool:
        """Whether the model runs in sequences, as the server says (``neuropod serve`` with the
        model metadata parameter ``neuropod_stateful``; Triton with ``sequence_batching`` in the
        model's configuration): then :meth:`infer` needs a ``sequence_id`` (or use
        :meth:`sequence`). False for a model of a server that does not say; such a model still
        takes sequences, and its server decides what they mean."""
        if self._stateful is not None:
            return self._stateful
        return _true(self._server_params.get(STATEFUL_PARAMETER))

    @property
    def state_spec(self) -> tuple[Any, ...]:
        """Empty: a remote model's state and its spec stay on the server."""
        return ()

    @property
    def sequence_controls(self) -> tuple[Any, ...]:
        """Empty: the server fills a remote model's control inputs."""
        return ()

    def configure_sequences(self, *, max_idle_s: float | None = None, max_live: int | None = None) -> None:
        raise NeuropodError(
            f"Remote model {self.name!r}: its sequences live on the server, which bounds them "
            "(neuropod serve --max-sequence-idle-us and its per-model bound on live sequences)"
        )

    def sequence(self, sequence_id: int | str | None = None) -> ModelSequence:
        """A new sequence of this model on its server: ``with model.sequence() as seq:
        seq.infer(inputs)`` (see :meth:`NeuropodModel.sequence`). Each step is one request with
        the sequence parameters ``sequence_id``, ``sequence_start`` (the first step) and
        ``sequence_end`` (``seq.infer(..., end=True)``); the state stays on the server. Leaving
        the ``with`` block without an ``end=True`` step sends nothing: the server frees the
        state when the sequence sits idle past its limit (``--max-sequence-idle-us``), so end
        the last step with ``end=True`` to free it at once. ``seq.state()`` is not available."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        return ModelSequence(self, sequence_id)

    def _end_sequence(self, sequence_id: int | str) -> bool:
        with self._homes_lock:
            self._homes.pop(sequence_id, None)
        return False  # nothing is sent: the server frees an idle sequence's state itself

    def _sequence_state(self, sequence_id: int | str) -> dict[str, Any]:
        raise SequenceError(
            f"sequence {sequence_id!r} of remote model {self.name!r}: its state stays on the server, which "
            "does not send it"
        )

    def _initial_states(self) -> list[Any]:
        raise SequenceError(f"remote model {self.name!r}: the initial state stays on the server, which does not send it")

    def infer_sequences(
        self, inputs: Mapping[str, Any], steps: Sequence[SequenceStep], requested_outputs: Sequence[str] | None = None,
        *, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One step of each of several sequences (see :meth:`NeuropodModel.infer_sequences`): the
        inputs are split along their first dim (``step.rows`` rows a step, in ``steps`` order)
        and each step goes as one request, all at once, as the sequence extension carries one
        sequence a request (the server may batch them again); the outputs are stacked back in
        order. When a step fails, the others may have run: the first error is raised after all
        answered.

        :raises SequenceError: a sequence appears twice, or the rows do not add up.
        """
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        steps = check_steps(steps, self.name)
        checked, _ = self._validator.check_inputs(inputs)
        check_rows(self.name, checked, steps)
        bounds = np.cumsum([0] + [s.rows for s in steps])
        parts = [{k: v[bounds[i] : bounds[i + 1]] for k, v in checked.items()} for i in range(len(steps))]

        def one(i: int) -> dict[str, np.ndarray]:
            step = steps[i]
            return self.infer(parts[i], requested_outputs, parameters=parameters, sequence_id=step.sequence_id,
                              sequence_start=step.start, sequence_end=step.end)  # fmt: skip

        if len(steps) == 1:
            answers = [one(0)]
        else:
            with ThreadPoolExecutor(max_workers=min(len(steps), 32), thread_name_prefix="neuropod-steps") as pool:
                futures = [pool.submit(one, i) for i in range(len(steps))]
                errors = [f.exception() for f in futures]
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
                answers = [f.result() for f in futures]
        return {k: np.concatenate([a[k] for a in answers]) for k in answers[0]}

    def _sequence_step(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, timeout: float | None,
        output_device: str | None, parameters: Mapping[str, Any] | None, sequence_id: Any, start: Any, end: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`infer` of one sequence's step (or of a stateful model without one, which refuses)."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        check_flag("sequence_start", start)
        check_flag("sequence_end", end)
        if sequence_id is None:
            if start or end:
                raise SequenceError("sequence_start and sequence_end need a sequence_id naming the sequence")
            raise SequenceError(
                f"remote model {self.name!r} carries state from one request of a sequence to the next: run it in "
                "a sequence (with model.sequence() as seq: seq.infer(inputs)), or call infer(inputs, "
                "sequence_id=..., sequence_start=True) for its first step"
            )
        sequence_id = check_sequence_id(sequence_id)
        if parameters and any(k in parameters for k in SEQUENCE_PARAMETERS):
            raise SequenceError("pass the sequence as infer's sequence_id / sequence_start / sequence_end, not as parameters")
        if self.decoupled:
            raise NeuropodError(f"Model {self.name!r} is decoupled: run it with infer_stream(inputs), not with infer")
        validator = self._validator
        requested = None if requested_outputs is None else validator.check_requested(requested_outputs)
        if output_device is not None:
            self._output_device(output_device)
        checked, bindings = validator.check_inputs(inputs)
        if parameters:
            check_parameters(parameters)
        sent = {**(parameters or {}), "sequence_id": sequence_id, "sequence_start": bool(start),
                "sequence_end": bool(end)}  # fmt: skip
        timeout = self._timeout if timeout is None else timeout
        if len(self._pool.servers) == 1:
            try:
                return self._send(checked, bindings, requested, timeout, sent)
            except RemoteError as e:
                raise sequence_error(e) from None
        return self._pinned_step(checked, bindings, requested, timeout, sent, sequence_id, bool(start), bool(end))

    def _pinned_step(
        self, checked: dict[str, np.ndarray], bindings: dict[str, tuple[int, str]], requested: list[str] | None,
        timeout: float | None, parameters: dict[str, Any], sequence_id: int | str, start: bool, end: bool,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """A sequence's step on a model of several servers: its first goes to the best server
        (retried on another as any call), which then holds its state; the later ones go there
        and nowhere else, not retried elsewhere (another server does not have the state)."""
        with self._homes_lock:
            home = self._homes.get(sequence_id)
        if home is None and not start:
            raise SequenceError(
                f"sequence {sequence_id!r} was not started through this remote model of {len(self._pool.servers)} "
                "servers, so which server holds its state is not known: start it here (sequence_start=True), or "
                "load the model from the one URL of the server that holds it"
            )
        outputs: dict[str, np.ndarray] = {}
        found: list[Server] = []

        def call(transport: Transport, remaining: float | None) -> dict[str, np.ndarray]:
            return self._send_on(transport, checked, bindings, requested, remaining, parameters)

        try:
            if start:
                # The first step: any server; pool.open says which took it (released at once).
                outputs, server = self._pool.open(call, timeout)
                self._pool.release(server)
                found.append(server)
            else:
                assert home is not None
                outputs = self._pool.call_on(home, call, timeout)
        except RemoteError as e:
            mapped = sequence_error(e)
            lost = home is not None and not start and e.code == "unavailable"
            if lost or isinstance(mapped, SequenceError):  # else (the model failed, a timeout) it may go on
                with self._homes_lock:
                    self._homes.pop(sequence_id, None)
            if lost:
                assert home is not None
                raise RemoteSequenceError(
                    f"sequence {sequence_id!r} of remote model {self.name!r}: the server that holds its state "
                    f"({home.transport.target.url}) cannot be reached ({e}); its state is lost with it or out of "
                    "reach. Start the sequence again (sequence_start=True)",
                    url=e.url, code=e.code, server_message=e.server_message,
                ) from None  # fmt: skip
            raise mapped from None
        with self._homes_lock:
            if end:
                self._homes.pop(sequence_id, None)
            elif found:
                self._homes[sequence_id] = found[0]
        return outputs

    def _checked_infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, call_options: Any,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`NeuropodModel._checked_infer` for a server's answer: the inputs are checked as
        for a local model (a SpecError), the outputs inside the call, so that outputs that do not
        fit the spec are a RemoteError naming the server that sent them."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if self.decoupled:
            raise NeuropodError(
                f"Model {self.name!r} is decoupled: it answers a request with any number of responses, so it "
                "runs with infer_stream(inputs), which returns them as they come, not with infer"
            )
        validator = self._validator
        if requested_outputs is not None:
            requested_outputs = validator.check_requested(requested_outputs)
        if output_device is not None:
            self._output_device(output_device)  # "cpu" or an error: outputs arrive in host memory
        checked, bindings = validator.check_inputs(inputs)
        if parameters:
            check_parameters(parameters)
        else:
            parameters = None
        timeout = self._timeout if call_options is None else call_options
        return self._send(checked, bindings, requested_outputs, timeout, parameters)

    def _send(
        self, checked: dict[str, np.ndarray], bindings: dict[str, tuple[int, str]], requested_outputs: list[str] | None,
        timeout: float | None, parameters: Mapping[str, Any] | None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """One call of checked inputs on the pool's best server; its outputs checked against the spec."""

        def call(transport: Transport, remaining: float | None) -> dict[str, np.ndarray]:
            return self._send_on(transport, checked, bindings, requested_outputs, remaining, parameters)

        return self._pool.call(call, timeout)

    def _send_on(
        self, transport: Transport, checked: dict[str, np.ndarray], bindings: dict[str, tuple[int, str]],
        requested_outputs: list[str] | None, remaining: float | None, parameters: Mapping[str, Any] | None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """One call on one server; its outputs checked against the spec."""
        # All outputs are named when the caller names none: some servers (MLServer's runtimes)
        # answer only a default output to a request that names none.
        requested = requested_outputs if requested_outputs is not None else self._all_outputs
        outputs = (
            transport.infer(checked, requested, remaining)
            if parameters is None
            else transport.infer(checked, requested, remaining, parameters)
        )
        if type(outputs) is not dict:
            raise remote_error(transport.target, "protocol", "its answer holds no outputs", call="infer")
        try:
            self._validator.check_outputs(outputs, bindings, requested_outputs)
        except SpecError as e:
            raise remote_error(transport.target, "protocol", f"its outputs do not fit the model's spec: {e}",
                               call="infer") from None  # fmt: skip
        return outputs

    @property
    def name(self) -> str:
        return self._name

    @property
    def platform(self) -> str:
        return self._platform

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self._inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        requested_outputs: Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        output_device: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run the model on a server (see :meth:`NeuropodModel.infer`).

        :param timeout: a deadline in seconds for this call: connecting,
            sending, waiting, reading and retries included (the model's
            ``timeout=`` by default; None there means no limit).
        :param output_device: None or ``"cpu"``; outputs of a remote model arrive in host memory.
        :param parameters: sent as the request's ``parameters`` (str to bool, int, float or str):
            ``neuropod serve`` hands them to a model that takes them (a python model whose
            function has a ``parameters`` keyword); ``timeout`` there is the server's request
            timeout in microseconds.
        :param sequence_id: the sequence this request is a step of (see :meth:`sequence`), sent
            with ``sequence_start`` and ``sequence_end`` as the request parameters of Triton's
            sequence extension; the server keeps the state. A :attr:`stateful` model needs one.
            With several servers, a sequence's steps go to the server that took its first step.
        :raises TypeError: ``parameters`` is not a mapping of str to bool, int, float or str.
        :raises RemoteError: the server could not be reached, did not answer
            in time (code ``deadline_exceeded``), refused or failed the call, or
            answered with outputs that do not fit the spec; it names the URL.
        :raises SequenceError: the server refused the sequence's step (a
            :class:`~neuropod_serving.client.RemoteSequenceError`, also a RemoteError: not live,
            or a :class:`~neuropod.errors.SequenceLimitError` when the model has its most live
            sequences), or the server holding its state cannot be reached.
        """
        if timeout is not None:
            check_seconds("timeout", timeout)
        if sequence_id is not None or sequence_start or sequence_end or self.stateful:
            return self._sequence_step(inputs, requested_outputs, timeout, output_device, parameters, sequence_id,
                                       sequence_start, sequence_end)  # fmt: skip
        return self._checked_infer(inputs, requested_outputs, timeout, output_device, parameters)

    def infer_stream(
        self,
        inputs: Mapping[str, np.ndarray],
        requested_outputs: Sequence[str] | None = None,
        *,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> ResponseStream:
        """Run the model on a server and return its responses as they arrive (see
        :meth:`NeuropodModel.infer_stream`): a decoupled model's over gRPC ``ModelStreamInfer``
        or REST ``infer_stream`` (Server-Sent Events), any other model's one answer from
        :meth:`infer`. Inputs are checked now; the call is sent when the stream is first read.
        ``close()`` (from any thread) cancels the call: the server stops the model's generator.

        :param timeout: a deadline in seconds for the whole stream (None: none; the model's
            ``timeout=`` bounds each ``infer``, not streams, which last as long as the model
            answers).
        :raises RemoteError: (from ``next``) the server could not be reached, refused the
            request, failed (after the responses before the failure), or sent a response that
            does not fit the spec; it names the URL.
        """
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
        if self.stateful:
            raise SequenceError(
                f"model {self.name!r} is stateful: it answers each step of a sequence once; run it with "
                "model.sequence() or infer(..., sequence_id=...), not infer_stream"
            )
        if timeout is not None:
            check_seconds("timeout", timeout)
        validator = self._validator
        requested = None if requested_outputs is None else validator.check_requested(requested_outputs)
        if parameters:
            check_parameters(parameters)
        else:
            parameters = None
        checked, bindings = validator.check_inputs(inputs)
        if not self.decoupled:
            call_timeout = self._timeout if timeout is None else timeout
            answer = one_answer(lambda: self._send(checked, bindings, requested, call_timeout, parameters))
            return ResponseStream(answer, _as_is, self._stream_failed)
        sent = requested if requested is not None else self._all_outputs

        def opener(transport: Transport, remaining: float | None) -> Any:
            return transport.open_stream(checked, sent, remaining, parameters)

        def check(target: Target, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            outputs = requested_only(outputs, requested)
            try:
                validator.check_outputs(outputs, dict(bindings), None, False, partial=True)
            except SpecError as e:
                raise remote_error(target, "protocol", f"a response does not fit the model's spec: {e}",
                                   call="infer_stream") from None  # fmt: skip
            return outputs

        return RemoteResponseStream(StreamSource(self._pool, opener, timeout, check), self._stream_failed)

    def _stream_failed(self, e: Exception) -> RemoteError:
        """The error for an unexpected exception while reading a stream (the caller chains ``e``)."""
        url = self.urls[0]
        return RemoteError(f"Remote model {', '.join(self.urls)}: the stream failed: {type(e).__name__}: {redact(str(e))}",
                           url=url, code="unknown")  # fmt: skip

    def status(self, timeout: float = CONNECT_TIMEOUT_S) -> list[dict[str, Any]]:
        """Each server's state: ``url``, ``live``, ``ready``, the server's ``name`` and
        ``version``, and the model's ``backend`` and ``device`` there when it says;
        ``error`` instead of what could not be asked. Never raises for a server that is down."""
        states = []
        for server in self._pool.servers:
            transport = server.transport
            state: dict[str, Any] = {"url": transport.target.url}
            try:
                state.update(transport.server(timeout))
                state["ready"] = transport.ready(timeout)
                params = transport.metadata(timeout).get("parameters")
                if isinstance(params, Mapping):
                    state["backend"] = params.get(BACKEND_PARAMETER)
                    state["device"] = params.get(DEVICE_PARAMETER)
            except RemoteError as e:
                state["error"] = str(e)
            state["calls"] = server.calls
            states.append(state)
        return states

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.backend.id} on {self.device}, {self.backend.location}"
        return f"<RemoteModel {self.name!r} ({self.platform or 'unknown platform'}) {state}>"


def _true(flag: Any) -> bool:
    return flag is True or (isinstance(flag, str) and flag.lower() == "true")


def _as_is(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return outputs


# --- loading -----------------------------------------------------------------
