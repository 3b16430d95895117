"""The Python backend: what neuropod adds to calling a model's own Python function.

    python bench/bench_python.py [--rounds 10] [--quick]

One trivial model (``out = x``, a 2x2 float32 input) packaged with
``create_python_neuropod`` and called three ways, each against calling the
model's function directly (``fn(x=x)``) in the same run, call by call
alternating (see ``_common.compare_per_call``):

* in-process (no requirements: the default);
* in a worker (``use_ope=True``);
* in its lock environment's worker: the same code packaged with
  ``requirements="six==1.16.0"``, which always runs out of process.

Plus the environment's costs, in a fresh ``NEUROPOD_HOME``: the first load
of a package with a new lock (the environment is built: venv, pip install of
the lock, the core and the plugin) and every later load (median of several).

Targets (issue 16): in-process added latency <= 3 us; environment worker
<= 50 us (as OPE); later loads < 1 s.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import neuropod
from _common import compare_per_call, verdict
from neuropod import envs
from neuropod.packagers import create_python_neuropod

MODEL = "def get_model(data_root):\n    def model(x):\n        return {'out': x}\n    return model\n"
SPEC_IN = [{"name": "x", "dtype": "float32", "shape": [2, 2]}]
SPEC_OUT = [{"name": "out", "dtype": "float32", "shape": [2, 2]}]
REQUIREMENT = "six==1.16.0"


def package(tmp: Path, name: str, requirements: str | None = None) -> Path:
    code = tmp / f"{name}_code"
    code.mkdir()
    (code / "trivial.py").write_text(MODEL)
    path: Path = create_python_neuropod(
        tmp / name, name, [], [{"python_root": code, "dirs_to_package": [""]}], "trivial", "get_model",
        SPEC_IN, SPEC_OUT, requirements=requirements,
    )  # fmt: skip
    return path


def direct_function(tmp: Path) -> object:
    """The model's function as its own code makes it, imported straight from the code directory."""
    sys.path.insert(0, str(tmp / "trivial_code"))
    try:
        import trivial  # type: ignore[import-not-found]

        return trivial.get_model(str(tmp))
    finally:
        sys.path.pop(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="thousands of alternating call pairs per case")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and loads, for a smoke test")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    inputs = {"x": x}
    print(f"Python {sys.version.split()[0]}, neuropod {neuropod.__version__}; model: out = x, a 2x2 float32 input")
    with tempfile.TemporaryDirectory(prefix="bench-python-") as tmp_dir:
        tmp = Path(tmp_dir)
        os.environ["NEUROPOD_HOME"] = str(tmp / "home")  # a fresh home: the first lock is really new
        plain = package(tmp, "trivial")
        fn = direct_function(tmp)

        def raw() -> object:
            return fn(x=x)  # type: ignore[operator]

        results = {}
        with neuropod.load_neuropod(plain) as model:
            results["in-process"] = compare_per_call(
                "in-process", raw, lambda: model.infer(inputs), rounds * 10000
            )
        with neuropod.load_neuropod(plain, use_ope=True) as model:
            results["worker"] = compare_per_call("worker (use_ope=True)", raw, lambda: model.infer(inputs), rounds * 1000)

        # The environment: package (locks and builds it, as the package's check loads it), forget it,
        # then time the first load (a build) and later loads.
        t0 = time.perf_counter()
        locked = package(tmp, "trivial_locked", REQUIREMENT)
        packaging = time.perf_counter() - t0
        envs.prune_environments(0)
        t0 = time.perf_counter()
        sink = io.StringIO()
        stderr, sys.stderr = sys.stderr, sink  # pip's progress: not part of the table
        try:
            model = neuropod.load_neuropod(locked)
        finally:
            sys.stderr = stderr
        first = time.perf_counter() - t0
        env_name = model.backend.location
        model.close()
        later = []
        for _ in range(3 if args.quick else 7):
            t0 = time.perf_counter()
            model = neuropod.load_neuropod(locked)
            later.append(time.perf_counter() - t0)
            model.close()
        with neuropod.load_neuropod(locked) as model:
            results["environment"] = compare_per_call(
                f"lock environment worker ({REQUIREMENT})", raw, lambda: model.infer(inputs), rounds * 1000
            )
        print(f"{'packaging with ' + REQUIREMENT:<44} {packaging:7.1f} s (pip resolves the lock; the check builds the environment)")
        print(f"{'first load, new lock (builds ' + env_name[4:] + ')':<44} {first:7.1f} s")
        print(f"{'later loads (environment built)':<44} median {statistics.median(later) * 1e3:7.0f} ms, "
              f"max {max(later) * 1e3:.0f} ms over {len(later)}")  # fmt: skip
    print()
    added = results["in-process"]["overhead"]
    verdict("in-process added latency <= 3 us", added <= 3e-6, f"{added * 1e6:.2f} us")
    added = results["worker"]["overhead"]
    verdict("worker (use_ope) added latency <= 50 us", added <= 50e-6, f"{added * 1e6:.1f} us")
    added = results["environment"]["overhead"]
    verdict("lock environment worker added latency <= 50 us", added <= 50e-6, f"{added * 1e6:.1f} us")
    verdict("later loads < 1 s", statistics.median(later) < 1.0, f"median {statistics.median(later) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
