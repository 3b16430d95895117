"""RemoteError messages: one wording for both protocols."""

from __future__ import annotations

from neuropod.errors import RemoteError, SequenceError, SequenceLimitError
from neuropod.storage.urls import redact
from neuropod_serving.client._target import Target

# What each code means, said to the user; {server} is the address.
_PROBLEMS = {
    "unavailable": "cannot reach the server at {server}",
    "deadline_exceeded": "no answer within the timeout",
    "not_found": "the server does not serve this model",
    "invalid_argument": "the server refused the request",
    "unauthenticated": "the server refused the call's credentials (see auth_token=)",
    "permission_denied": "the server refused the call's credentials (see auth_token=)",
    "internal": "the model failed on the server",
    "tls": "the TLS handshake with {server} failed",
    "resource_exhausted": "the server refused the message as too large, or is overloaded",
    "protocol": "the server's answer does not follow the Open Inference Protocol",
    "unimplemented": "the server does not implement this call",
}

#: HTTP status -> code.
HTTP_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    413: "resource_exhausted",
    429: "resource_exhausted",
    500: "internal",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}

# Words in a connection failure that mean TLS went wrong (retrying does not help).
_TLS_WORDS = ("ssl", "tls", "certificate", "handshake")


def stream_error_code(message: str) -> str:
    """The code of an error a server reported inside a stream (gRPC ``ModelStreamInfer``'s
    ``error_message``, a Server-Sent Events ``{"error": ...}`` event), which carries no status:
    read from ``neuropod serve``'s wording. ``unavailable``: the server stopped the stream
    (``stream of model 'm' ended: ...``); ``resource_exhausted``: the model has its most streams
    open; ``internal``: the model failed (``model 'm' failed: ...``), and any other server's error."""
    if (message.startswith("stream of model ") and " ended: " in message) or message.startswith(
        "ModelStreamInfer takes no more requests"
    ):
        return "unavailable"
    if "--max-open-streams" in message:
        return "resource_exhausted"
    return "internal"


def looks_like_tls(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in _TLS_WORDS)


def remote_error(target: Target, code: str, detail: str | None, *, call: str = "", timeout: float | None = None) -> RemoteError:
    """A RemoteError naming the URL, what went wrong and the server's (or the transport's) words,
    each URL in them redacted (a server's error may name the presigned URL its model failed on)."""
    problem = _PROBLEMS.get(code, code.replace("_", " ")).format(server=target.server)
    if code == "deadline_exceeded" and timeout is not None:
        problem = f"no answer within {timeout:.3g} s"
    doing = f" ({call})" if call else ""
    text = f"Remote model {target.url}{doing}: {problem}"
    detail = redact((detail or "").strip())
    if detail:
        text += f": {detail}"
    return RemoteError(text, url=target.url, code=code, server_message=detail or None)


class RemoteSequenceError(RemoteError, SequenceError):
    """A server refused a sequence's step (not live: never started, ended or expired; a wrong id
    kind; a stateful model without a sequence), or the server holding its state is gone: both a
    :class:`~neuropod.errors.RemoteError` (``url``, ``code``, ``server_message``) and a
    :class:`~neuropod.errors.SequenceError`."""


class RemoteSequenceLimitError(RemoteSequenceError, SequenceLimitError):
    """A server refused to start a sequence: the model has its most live sequences (429 /
    RESOURCE_EXHAUSTED). Also a :class:`~neuropod.errors.SequenceLimitError`."""


# The server's words of a SequenceError (neuropod.sequences, neuropod.model) that a server which
# does not map it to a status (an older neuropod serve) sends as a model failure.
_SEQUENCE_WORDS = (" is not live on model ", "carries state from one request", " is not stateful",
                   " sequence ids (its CORRID ", "sequence id ")  # fmt: skip


def sequence_error(e: RemoteError) -> RemoteError:
    """``e``, the error of a request that named a sequence, as a :class:`RemoteSequenceError`
    (or :class:`RemoteSequenceLimitError`) when the server refused the sequence; else ``e``."""
    detail = e.server_message or ""
    limit = e.code == "resource_exhausted" and "sequence" in detail
    refused = e.code == "invalid_argument" and "sequence" in detail
    if not (limit or refused or (e.code == "internal" and any(w in detail for w in _SEQUENCE_WORDS))):
        return e
    cls = RemoteSequenceLimitError if limit or "live sequences, its most" in detail else RemoteSequenceError
    return cls(str(e), url=e.url, code=e.code, server_message=e.server_message)
