"""TensorFlow imported, and its models loaded, with its C++ start-up logs held back.

TensorFlow prints log lines from C++ as it starts (some before its own log
settings are read). Unless the user set ``TF_CPP_MIN_LOG_LEVEL`` (asking
for them), ``TF_CPP_MIN_LOG_LEVEL=2`` is set for this process and stderr is
captured while TensorFlow is imported and a model is loaded; what it
printed is shown only if that fails.

Imports no TensorFlow (nor numpy) until :func:`import_tensorflow` is called.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

#: Held while file descriptor 2 is redirected and while a session's callables are made: both
#: touch TensorFlow's process-wide state. Reentrant: a callable is made inside a quiet window.
LOCK = threading.RLock()

# Whether the user asked for TensorFlow's logs, decided before we set our default.
_user_wants_logs = "TF_CPP_MIN_LOG_LEVEL" in os.environ


@contextlib.contextmanager
def quiet_stderr(what: str) -> Iterator[None]:
    """Capture file descriptor 2 while TensorFlow starts; replay it only on failure.

    TensorFlow writes to the C-level stderr, so ``sys.stderr`` redirection
    does not reach it. Other threads' stderr output in this window is kept
    and written out afterwards.
    """
    if _user_wants_logs:
        yield
        return
    with LOCK, tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            keep = text if failed else not_tensorflow(text)
            if keep.strip():
                sys.stderr.write(keep if not failed else f"[TensorFlow's output while {what}]\n{keep}")
                sys.stderr.flush()


def not_tensorflow(text: str) -> str:
    """Lines that are not TensorFlow's C++ log lines (kept: they belong to someone else)."""
    prefixes = ("I0000", "W0000", "E0000", "WARNING: All log messages before absl::InitializeLog()")
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith(prefixes) and " cpu_feature_guard.cc" not in line)


def import_tensorflow() -> Any:
    """Import TensorFlow quietly (see the module docstring), once."""
    if sys.modules.get("tensorflow") is not None:  # None: an import of it was blocked
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with quiet_stderr("importing tensorflow"):
        import tensorflow as tf
    # Memory growth must be set before a GPU is first used: TensorFlow would
    # otherwise take all of every visible GPU's memory for itself.
    for gpu in tf.config.list_physical_devices("GPU"):
        with contextlib.suppress(RuntimeError, ValueError):
            tf.config.experimental.set_memory_growth(gpu, True)
    return tf
