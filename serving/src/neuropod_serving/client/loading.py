"""Loading a remote model from its URLs: options checked, transports made, the spec read from every server."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from neuropod._args import check_flag, check_seconds
from neuropod.errors import NeuropodError, PluginNotInstalledError, RemoteError
from neuropod.plugins import pip_install
from neuropod.spec import TensorSpec
from neuropod_serving.client._http import HttpTransport
from neuropod_serving.client._pool import Pool, Transport
from neuropod_serving.client._target import SCHEMES, Target, is_loopback, parse_url
from neuropod_serving.client.remote_model import BACKEND_PARAMETER, CONNECT_TIMEOUT_S, RemoteModel
from neuropod_serving.protocol.metadata import specs_from_model_metadata

#: Extra attempts of a call that found its server unavailable.
DEFAULT_RETRIES = 2

_INSTALL_EXTRA = "'neuropod-serving[client]'"


class PlainTextTokenWarning(UserWarning):
    """``auth_token`` is sent without TLS to a server that is not on this machine."""



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
        bytes_outputs = frozenset(s.name for s in spec[1] if s.dtype == "bytes")
        for transport in transports:
            transport.bytes_outputs = bytes_outputs  # their BYTES come back as the bytes sent, not text
        params = metadata.get("parameters")
        # neuropod serve says whether a model is decoupled in its metadata; other servers (Triton)
        # in the model's configuration, asked here.
        from_neuropod = isinstance(params, Mapping) and BACKEND_PARAMETER in params
        flags = None if from_neuropod else _config_flags(pool, connect_timeout)
        decoupled, stateful = (None, None) if flags is None else flags
        return RemoteModel(targets, pool, metadata, spec, timeout=timeout, decoupled=decoupled, stateful=stateful)
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
            # lazy: grpcio and protobuf (the [client] extra), imported for grpc:// URLs only
            from neuropod_serving.client._grpc import GrpcTransport
        except ImportError as e:
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


def _config_flags(pool: Pool, timeout: float | None) -> tuple[bool, bool] | None:
    """Whether the model's configuration says it is decoupled, and stateful (``sequence_batching``),
    from the first server up that answers; None when none has a model configuration to ask (MLServer)."""
    now = time.monotonic()
    for server in pool.servers:
        if server.down_until <= now:
            found = server.transport.config_flags(timeout)
            if found is not None:
                return found
    return None


def _spec(target: Target, metadata: Mapping[str, Any]) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The input and output specs in one server's model metadata.

    :raises RemoteError: the metadata cannot be read as a spec (code ``protocol``), naming the URL.
    """
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

