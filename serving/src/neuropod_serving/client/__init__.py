"""Remote models: ``neuropod.load_neuropod("grpc://host:8001/model")``.

The core finds :func:`load` through the ``neuropod.remotes`` entry points
(one per URL scheme: grpc, grpcs, http, https) and returns what it returns:
a :class:`RemoteModel`, which is a :class:`~neuropod.model.NeuropodModel`
like any other. Its spec is rebuilt from the server's model metadata, inputs
are checked against it before anything is sent (the same ``SpecError`` as a
local model), tensors travel as raw bytes, and every transport or server
fault is a :class:`~neuropod.errors.RemoteError` naming the URL.

No server is trusted: sizes an answer announces cost memory only as their
bytes arrive, shapes must match the data sent with them, outputs are checked
against the output spec (a misfit is a RemoteError naming the server, code
``protocol``), ``timeout=`` is a deadline for the whole call on both
transports, and a token sent without TLS to a host that is not loopback
warns (:class:`PlainTextTokenWarning`, once per server and process).

The far end is any Open Inference Protocol server: ``neuropod serve``,
Triton, MLServer, KServe. A neuropod server also sends each tensor's exact
spec shape (symbol names) and says which backend and device run the model;
from other servers, -1 dims become ``None`` (any size).

Needs ``pip install 'neuropod-serving[client]'`` (grpcio and protobuf; the
REST transport is Python's own ``http.client``). Importing this package
imports neither; the transports are imported when a model is loaded.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod._args import check_flag, check_parameters, check_seconds
from neuropod.backend import Backend
from neuropod.errors import NeuropodError, PluginNotInstalledError, RemoteError, SpecError
from neuropod.model import NeuropodModel
from neuropod.spec import SpecValidator, TensorSpec
from neuropod_serving import __version__
from neuropod_serving.client._errors import remote_error
from neuropod_serving.client._pool import Pool, Transport
from neuropod_serving.client._target import SCHEMES, Target, is_loopback, parse_url

#: Seconds that loading (metadata and readiness calls) may take per server.
CONNECT_TIMEOUT_S = 10.0
#: Extra attempts of a call that found its server unavailable.
DEFAULT_RETRIES = 2
#: Model-level metadata parameters a neuropod server sends (REST ``parameters``;
#: gRPC carries them in the ``neuropod-shapes`` trailer).
BACKEND_PARAMETER = "neuropod_backend"
DEVICE_PARAMETER = "neuropod_device"
#: ``"separate"`` for a package the original Neuropod wrote: spec symbols are bound within the
#: inputs and within the outputs, not across both (see :class:`neuropod.spec.SpecValidator`).
SYMBOLS_PARAMETER = "neuropod_symbols"

_INSTALL_EXTRA = "'neuropod-serving[client]'"


class PlainTextTokenWarning(UserWarning):
    """``auth_token`` is sent without TLS to a server that is not on this machine."""


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

    The same ``infer``, ``inputs``, ``outputs``, ``name``, ``close()`` and
    context manager as a local model, and thread-safe. Extra: ``infer(...,
    timeout=)`` for one call, :attr:`urls`, :meth:`status`.

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
    ):
        inputs, outputs = spec
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
        self._closed = False
        self._close_lock = threading.Lock()

    def _bind_infer(self) -> None:
        pass  # _run sends the call; there is no plugin hook to bind

    def _no_device_tensors(self) -> str:
        return "a remote model's tensors travel to the server from host memory; pass numpy arrays (or CPU tensors)"

    def _checked_infer(
        self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, call_options: Any,
        output_device: str | None = None, parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`NeuropodModel._checked_infer` for a server's answer: the inputs are checked as
        for a local model (a SpecError), the outputs inside the call, so that outputs that do not
        fit the spec are a RemoteError naming the server that sent them."""
        if self._closed:
            raise NeuropodError(f"Model {self.name!r} is closed")
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


# --- loading -----------------------------------------------------------------

_OPTIONS = ("timeout", "retries", "auth_token", "tls", "ca_cert", "tls_server_name", "connect_timeout", "check_ready")


def load(urls: str | Sequence[str], **options: Any) -> RemoteModel:
    """Load a remote model (the ``neuropod.remotes`` entry point; use ``neuropod.load_neuropod(url)``).

    :param urls: ``SCHEME://HOST[:PORT]/MODEL[/VERSION]``, or several for a pool of
        servers (see :mod:`neuropod_serving.client._pool` for the policy).
    :param timeout: a deadline in seconds for each ``infer``, retries included (None: no limit).
    :param retries: extra attempts of a call that found its server unavailable (default 2).
    :param auth_token: sent as ``authorization: Bearer <token>``; without TLS to a host
        that is not loopback, a :class:`PlainTextTokenWarning` (once per server and process).
    :param tls: True or False to force TLS on or off whatever the scheme says
        (grpcs and https are TLS).
    :param ca_cert: a PEM file of the certificates to trust (default: the system's).
    :param tls_server_name: the name the server's certificate must have, when it
        is not the URL's host (e.g. a cert for ``localhost`` reached by IP).
    :param connect_timeout: seconds each loading call may take (default 10).
    :param check_ready: ask each server whether the model is ready (default True);
        a model no server has ready fails to load.
    :raises RemoteError: no server answered with the model's metadata (each is named).
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:  # a NeuropodError, as a backend's refusal of an option it does not know
        raise NeuropodError(
            f"load_neuropod(): {', '.join(map(repr, unknown))} is not an option of remote models; "
            f"they take {', '.join(_OPTIONS)}"
        )
    timeout = options.get("timeout")
    check_seconds("timeout", timeout)
    connect_timeout = options.get("connect_timeout", CONNECT_TIMEOUT_S)
    check_seconds("connect_timeout", connect_timeout)
    retries = options.get("retries", DEFAULT_RETRIES)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise TypeError(f"retries must be an int >= 0, not {retries!r:.60}")
    tls = options.get("tls")
    if tls is not None:
        check_flag("tls", tls)
    check_ready = options.get("check_ready", True)
    check_flag("check_ready", check_ready)
    auth_token = options.get("auth_token")
    if auth_token is not None and (not isinstance(auth_token, str) or not auth_token or "\n" in auth_token or "\r" in auth_token):
        raise TypeError("auth_token must be a non-empty str on one line")
    server_name = options.get("tls_server_name")
    if server_name is not None and not isinstance(server_name, str):
        raise TypeError(f"tls_server_name must be a str, not {type(server_name).__name__}")

    url_list = [urls] if isinstance(urls, str) else list(urls)
    if not url_list:
        raise ValueError("load_neuropod() was given an empty list of URLs")
    targets = [parse_url(u, tls=tls) for u in url_list]
    if auth_token is not None:
        _warn_plain_token(targets)
    transports = _transports(targets, auth_token, options.get("ca_cert"), server_name)
    pool = Pool(transports, retries=retries)
    try:
        metadata, spec = _metadata(pool, check_ready=check_ready, timeout=connect_timeout)
        return RemoteModel(targets, pool, metadata, spec, timeout=timeout)
    except BaseException:
        pool.close()
        raise


# Servers already warned about (host, port): one warning per server per process.
_WARNED_PLAIN_TOKEN: set[tuple[str, int]] = set()
_WARNED_LOCK = threading.Lock()


def _warn_plain_token(targets: list[Target]) -> None:
    """Warn, once per server and process, that ``auth_token`` goes as plain text to a server
    beyond this machine (a URL without TLS whose host is not loopback)."""
    for t in targets:
        if t.tls or is_loopback(t.host):
            continue
        with _WARNED_LOCK:
            if (t.host, t.port) in _WARNED_PLAIN_TOKEN:
                continue
            _WARNED_PLAIN_TOKEN.add((t.host, t.port))
        warnings.warn(
            f"Remote model {t.url}: auth_token is sent as plain text to {t.address}, a server beyond this "
            f"machine, without TLS: anyone on the network path can read it. Use "
            f"{'grpcs' if t.protocol == 'grpc' else 'https'}:// (or tls=True) for a server that is not local",
            PlainTextTokenWarning,
            stacklevel=5,  # the caller of load_neuropod (-> load_remote -> load -> here)
        )


def _transports(targets: list[Target], auth_token: str | None, ca_cert: Any, server_name: str | None) -> list[Transport]:
    # Only a grpc:// URL imports grpcio and the protobuf messages: an http:// model works
    # without them, and in a process whose other gRPC stack would clash with them.
    if any(t.protocol == "grpc" for t in targets):
        try:
            from neuropod_serving.client._grpc import GrpcTransport
        except ImportError as e:
            from neuropod.plugins import pip_install

            raise PluginNotInstalledError(
                f"gRPC remote models need grpcio and protobuf ({e}): {pip_install(_INSTALL_EXTRA)}"
            ) from None
    root: bytes | None = None
    context = None
    if ca_cert is not None:
        if not isinstance(ca_cert, (str, os.PathLike)):
            raise TypeError(f"ca_cert must be a path to a PEM file, not {type(ca_cert).__name__}")
        try:
            with open(ca_cert, "rb") as f:
                root = f.read()
        except OSError as e:
            raise NeuropodError(f"ca_cert {os.fspath(ca_cert)!r} cannot be read: {e.strerror or e}") from None
        if any(t.protocol == "http" and t.tls for t in targets):
            import ssl

            try:
                context = ssl.create_default_context(cadata=root.decode("ascii", "replace"))
            except ssl.SSLError as e:
                raise NeuropodError(f"ca_cert {os.fspath(ca_cert)!r} holds no usable PEM certificate: {e}") from None
    from neuropod_serving.client._http import HttpTransport

    transports: list[Transport] = []
    for t in targets:
        if t.protocol == "grpc":
            transports.append(GrpcTransport(t, auth_token=auth_token, root_certificates=root, tls_server_name=server_name))
        else:
            transports.append(HttpTransport(t, auth_token=auth_token, ssl_context=context, tls_server_name=server_name))
    return transports


def _metadata(
    pool: Pool, *, check_ready: bool, timeout: float | None
) -> tuple[dict[str, Any], tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """The model's metadata and spec, from every server that answers; they must agree on the spec.
    A server that does not answer is marked down (the pool skips it for a while)."""
    found: list[tuple[Target, dict[str, Any]]] = []
    errors: list[RemoteError] = []
    for server in pool.servers:
        transport = server.transport
        try:
            metadata = transport.metadata(timeout)
            if check_ready and not transport.ready(timeout):
                raise RemoteError(
                    f"Remote model {transport.target.url}: the server has the model but it is not ready",
                    url=transport.target.url, code="unavailable",
                )  # fmt: skip
        except RemoteError as e:
            if e.code not in ("unavailable", "deadline_exceeded") or len(pool.servers) == 1:
                raise
            errors.append(e)
            pool.mark_down(server)
            continue
        found.append((transport.target, metadata))
    if not found:
        raise RemoteError(
            "No server of the remote model answered: " + "; ".join(str(e) for e in errors),
            url=errors[0].url, code="unavailable",
        )  # fmt: skip
    first_target, first = found[0]
    spec = _spec(first_target, first)
    for target, metadata in found[1:]:
        if _spec(target, metadata) != spec:
            raise RemoteError(
                f"The servers of the remote model disagree on its spec: {first_target.url} and {target.url} "
                "serve different inputs or outputs; give URLs of one model",
                url=target.url, code="protocol",
            )  # fmt: skip
    return first, spec


def _spec(target: Target, metadata: Mapping[str, Any]) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The input and output specs in one server's model metadata.

    :raises RemoteError: the metadata cannot be read as a spec (code ``protocol``), naming the URL.
    """
    from neuropod_serving.protocol import specs_from_model_metadata

    try:
        return specs_from_model_metadata(metadata)
    except NeuropodError as e:
        raise RemoteError(
            f"Remote model {target.url}: the server's model metadata cannot be read as a spec: {e}",
            url=target.url, code="protocol", server_message=None,
        ) from None  # fmt: skip


def schemes() -> list[str]:
    """The URL schemes this package loads."""
    return list(SCHEMES)


__all__ = ["PlainTextTokenWarning", "RemoteBackend", "RemoteError", "RemoteModel", "load", "schemes"]
