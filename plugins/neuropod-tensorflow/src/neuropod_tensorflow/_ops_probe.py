"""Which ops a TensorFlow custom-op library registers, learnt in a fresh interpreter.

TensorFlow cannot register one op twice: a package's op library whose ops
this process already has from another file (the user loaded their own build
of it) fails at run time with "Multiple OpKernel registrations match
NodeDef", or worse. So before a package's library is loaded, the backend asks
which op names it registers and whether any is registered here already
(:func:`clash`); if so the model runs in a worker process instead.

The names are learnt by loading the library in a new interpreter, where a
library that crashes on load harms nobody::

    python -m neuropod_tensorflow._ops_probe LIBRARY

prints one line, ``{"ops": [...], "tensorflow": "<version>"}``, and exits 0.
The answer is kept on disk per library content and TensorFlow version
(:func:`neuropod.backend.cached_probe`), so each library is probed once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import neuropod
import neuropod_tensorflow
from neuropod import cache
from neuropod.backend import cached_probe
from neuropod.errors import PackageError

#: Seconds a probe may take (importing TensorFlow is most of it).
PROBE_TIMEOUT = 180.0

_MARK = "NEUROPOD_TF_OPS "


def library_ops(tf: Any, path: Path, where: str) -> list[str]:
    """The op names the library at ``path`` registers, probed once per content and TensorFlow version.

    :raises PackageError: the library does not load in a fresh process, or
        the probe crashed or ran past :data:`PROBE_TIMEOUT`.
    """
    key = f"{cache.sha256_file(path)}-tensorflow-{tf.__version__}"
    ops = cached_probe("tensorflow-ops", key, lambda: _probe(path, tf.__version__, where))
    if not isinstance(ops, list):  # a damaged cache entry
        ops = _probe(path, tf.__version__, where)
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


def _probe(path: Path, version: str, where: str) -> list[str]:
    what = (
        f"{where}: custom op library {path.name} failed to load in tensorflow {version} "
        "(loaded alone in a fresh process to learn its ops)"
    )
    if not sys.executable:
        raise PackageError(f"{what}: this interpreter does not know its own executable (sys.executable is empty)")
    env = {**os.environ}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Wherever this process found neuropod and this plugin (a path added at run time too), the probe
    # finds them; appended, so nothing the environment already resolves is shadowed.
    found = [str(Path(m.__file__).resolve().parents[1]) for m in (neuropod, neuropod_tensorflow) if m.__file__]
    paths = [*env.get("PYTHONPATH", "").split(os.pathsep), *found]
    env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys(paths) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "neuropod_tensorflow._ops_probe", str(path)],
            capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PackageError(f"{what}: the probe did not finish within {PROBE_TIMEOUT:g} s") from None
    except OSError as e:
        raise PackageError(f"{what}: the probe could not start: {e}") from None
    for line in reversed(done.stdout.splitlines()):
        if done.returncode == 0 and line.startswith(_MARK):
            try:
                found = json.loads(line[len(_MARK) :])
                return [str(name) for name in found["ops"]]
            except (ValueError, KeyError, TypeError):
                break
    if done.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"killed by signal {-done.returncode}"
    else:
        how = f"exit code {done.returncode}"
    from neuropod_tensorflow._runtime import _not_tensorflow

    said = _not_tensorflow(done.stderr).strip() or done.stdout.strip()
    tail = "\n".join(said.splitlines()[-15:]) or "(no output)"
    raise PackageError(f"{what}: the probe failed ({how}):\n{tail}")


def main(argv: list[str]) -> int:
    """Load one library and print the op names it registered."""
    if len(argv) != 1:
        print("usage: python -m neuropod_tensorflow._ops_probe LIBRARY", file=sys.stderr)
        return 2
    import tensorflow as tf
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.framework import load_library

    # What tf.load_op_library does, keeping the op list it reads from the
    # library (the module it returns holds only generated Python wrappers).
    py_tf = load_library.py_tf
    try:
        handle = py_tf.TF_LoadLibrary(argv[0])
    except (tf.errors.OpError, OSError, RuntimeError) as e:  # its message is what matters
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        op_list = op_def_pb2.OpList.FromString(py_tf.TF_GetOpList(handle))
    finally:
        py_tf.TF_DeleteLibraryHandle(handle)
    names = sorted(op.name for op in op_list.op)
    print(_MARK + json.dumps({"ops": names, "tensorflow": tf.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
