"""A model that raises ``SystemExit`` or ``KeyboardInterrupt`` while it runs: a failed request, not a
stopped server.

Python code can raise either (``sys.exit``, an ``argparse`` error, a library that treats a bad
argument as the end of a script). Neither derives from ``Exception``, so every layer that answers a
request's failure would let them through: a gRPC worker thread ends with its call unanswered (the
client waits for its deadline), an event loop's task re-raises them into the loop. The engine turns
them into a :class:`~neuropod.errors.BackendError` where it calls the model, and the front ends do the
same for any that reach them another way (a sequence's step, a stream): the client is answered at
once with the model's failure (500, gRPC INTERNAL) and the server keeps serving.

``neuropod serve`` handles SIGINT and SIGTERM itself (its server stops), so a real Ctrl-C never
arrives as a model's ``KeyboardInterrupt``; the engine still lets one through on the main thread of a
program of its own, where it may be the user's.
"""

from __future__ import annotations

import threading

from neuropod.errors import BackendError

#: What a model may raise that is no ``Exception``, and that must not stop the server.
EXITS = (SystemExit, KeyboardInterrupt)


def model_exited(model: str, exc: BaseException) -> BackendError:
    """The request's failure for ``exc`` (one of :data:`EXITS`) raised while model ``model`` ran
    (the caller chains ``exc``)."""
    what = type(exc).__name__
    if isinstance(exc, SystemExit) and exc.code is not None:
        what += f"({exc.code!r})"
    return BackendError(
        f"model {model!r} raised {what} while it ran; a model's code must not exit or interrupt the process "
        "(the request failed; the server keeps serving)"
    )


def is_users_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` may be a real Ctrl-C: a ``KeyboardInterrupt`` on the main thread, which the
    engine lets through rather than answer as the model's failure."""
    return isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()


__all__ = ["EXITS", "is_users_interrupt", "model_exited"]
