"""The remote model: a :class:`~neuropod.model.NeuropodModel` whose runs go to Open Inference Protocol servers."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod._args import check_parameters, check_seconds
from neuropod.backend import Backend
from neuropod.errors import NeuropodError, RemoteError, SpecError
from neuropod.model import NeuropodModel
from neuropod.spec import SpecValidator, TensorSpec
from neuropod.streams import ResponseStream
from neuropod_serving import __version__
from neuropod_serving.client._errors import remote_error
from neuropod_serving.client._pool import Pool, Transport
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
    ):
        inputs, outputs = spec
        self._decoupled = decoupled
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
        validator = self._validator
        # All outputs are named when the caller names none: some servers (MLServer's runtimes)
        # answer only a default output to a request that names none.
        requested = requested_outputs if requested_outputs is not None else self._all_outputs

        def call(transport: Transport, remaining: float | None) -> dict[str, np.ndarray]:
            outputs = (
                transport.infer(checked, requested, remaining)
                if parameters is None
                else transport.infer(checked, requested, remaining, parameters)
            )
            if type(outputs) is not dict:
                raise remote_error(transport.target, "protocol", "its answer holds no outputs", call="infer")
            try:
                validator.check_outputs(outputs, bindings, requested_outputs)
            except SpecError as e:
                raise remote_error(transport.target, "protocol", f"its outputs do not fit the model's spec: {e}",
                                   call="infer") from None  # fmt: skip
            return outputs

        return self._pool.call(call, timeout)

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
        :raises TypeError: ``parameters`` is not a mapping of str to bool, int, float or str.
        :raises RemoteError: the server could not be reached, did not answer
            in time (code ``deadline_exceeded``), refused or failed the call, or
            answered with outputs that do not fit the spec; it names the URL.
        """
        if timeout is not None:
            check_seconds("timeout", timeout)
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
        return RemoteError(f"Remote model {', '.join(self.urls)}: the stream failed: {type(e).__name__}: {e}",
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


def _as_is(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return outputs


# --- loading -----------------------------------------------------------------
