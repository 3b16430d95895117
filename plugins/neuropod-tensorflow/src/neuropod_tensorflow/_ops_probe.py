"""Which ops a TensorFlow custom-op library registers, learnt in a fresh interpreter.

TensorFlow cannot register one op twice: a package's op library whose ops
this process already has from another file (the user loaded their own build
of it) fails at run time with "Multiple OpKernel registrations match
NodeDef", or worse. So before a package's library is loaded, the backend asks
which op names it registers and whether any is registered here already
(:func:`clash`); if so the model runs in a worker process instead.

The names are learnt by loading the library in a new interpreter, where a
library that crashes on load harms nobody (:func:`neuropod.probe.run_probe`
running :func:`registered_ops`). The answer is kept on disk per library
content and TensorFlow version (:func:`neuropod.backend.cached_probe`), so
each library is probed once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from neuropod import cache
from neuropod.backend import cached_probe
from neuropod.probe import ProbeFailure, run_probe
from neuropod_tensorflow._quiet import not_tensorflow


def library_ops(tf: Any, path: Path, where: str) -> list[str]:
    """The op names the library at ``path`` registers, probed once per content and TensorFlow version.

    :raises PackageError: the library does not load in a fresh process, or
        the probe crashed or ran past :data:`neuropod.probe.PROBE_TIMEOUT`.
    """

    def probe() -> Any:
        what = (
            f"{where}: custom op library {path.name} failed to load in tensorflow {tf.__version__} "
            "(loaded alone in a fresh process to learn its ops)"
        )
        env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        return run_probe(
            "neuropod_tensorflow._ops_probe:registered_ops", [str(path)], what, env=env, clean_output=not_tensorflow
        )

    key = f"{cache.sha256_file(path)}-tensorflow-{tf.__version__}"
    ops = cached_probe("tensorflow-ops", key, probe, lambda found: isinstance(found, list))
    return [str(name) for name in ops]


def clash(tf: Any, path: Path, where: str) -> str | None:
    """Why the library at ``path`` cannot be loaded into this process, or None when it can.

    It cannot when an op it registers is registered here already (by a
    library from another file, or by TensorFlow itself).
    """
    from tensorflow.python.framework import op_def_registry

    taken = [name for name in library_ops(tf, path, where) if op_def_registry.get(name) is not None]
    if not taken:
        return None
    return (
        f"it registers op(s) {', '.join(map(repr, taken))}, which this process already has from another "
        f"library or from TensorFlow itself, and tensorflow {tf.__version__} cannot register an op twice"
    )


def registered_ops(library: str) -> list[str]:
    """The probe (run in the fresh interpreter): load one library and list the op names it registers."""
    import tensorflow as tf
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.framework import load_library

    # What tf.load_op_library does, keeping the op list it reads from the
    # library (the module it returns holds only generated Python wrappers).
    py_tf = load_library.py_tf
    try:
        handle = py_tf.TF_LoadLibrary(library)
    except (tf.errors.OpError, OSError, RuntimeError) as e:  # its message is what matters
        raise ProbeFailure(f"{type(e).__name__}: {e}") from None
    try:
        op_list = op_def_pb2.OpList.FromString(py_tf.TF_GetOpList(handle))
    finally:
        py_tf.TF_DeleteLibraryHandle(handle)
    return sorted(op.name for op in op_list.op)
