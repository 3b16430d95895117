"""Discovery cost: ``import neuropod`` and listing backends, in fresh interpreters.

    python bench/bench_discovery.py [--runs 9]

Targets (issue 2): listing backends with four plugins' entry points present
under 100 ms, and no framework imported. Plugins of the four platforms that
are not installed are stood in for by small distributions that do what a
real plugin's discovery does (a metadata lookup of their framework).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import importlib_metadata

_STAND_IN = '''
"""Stand-in for the {platform} plugin, for timing discovery only: it does what a
real plugin's discovery does (metadata lookups of its framework), no more."""
from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

@hookimpl
def supported_versions():
    found = installed_distribution(*{dists!r})
    return [Backend("{platform}", found[1], found[0])] if found else []

@hookimpl
def device_caps(backend):
    return DeviceCaps() if backend.platform == "{platform}" else None
'''

_STAND_INS = {  # platform -> the distributions its framework comes as
    "torchscript": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
    "tensorrt": ("tensorrt", "tensorrt-cu12"),
}


def _stand_in_site() -> Path:
    """A directory with three small distributions whose entry points join neuropod-onnx's."""
    site = Path(tempfile.mkdtemp(prefix="neuropod-bench-site-"))
    for platform, dists in _STAND_INS.items():
        if any(ep.name == platform for ep in importlib_metadata.entry_points(group="neuropod.backends")):
            continue  # the real plugin is installed: time that one
        module = f"bench_standin_{platform}"
        (site / f"{module}.py").write_text(_STAND_IN.format(platform=platform, dists=dists))
        info = site / f"bench_standin_{platform}-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bench-standin-{platform}\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[neuropod.backends]\n{platform} = {module}\n")
    return site


def _in_fresh_python(code: str, env: dict[str, str], runs: int = 9) -> list[str]:
    outs = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(out.stdout.strip())
    return outs


def discovery(runs: int) -> None:
    env = dict(os.environ)
    t_import = [
        float(x)
        for x in _in_fresh_python(
            "import time; t=time.perf_counter(); import neuropod; print(time.perf_counter()-t)", env, runs
        )
    ]
    site = _stand_in_site()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    code = textwrap.dedent(
        """
        import sys, time
        t = time.perf_counter()
        import neuropod.plugins as p  # includes `import neuropod`
        bs = p.installed_backends()
        caps = [p.backend_caps(b) for b in bs]
        dt = time.perf_counter() - t
        eps = [ep.name for ep in __import__('importlib_metadata').entry_points(group='neuropod.backends')]
        heavy = [m for m in ('torch', 'tensorflow', 'onnxruntime', 'tensorrt', 'onnx', 'numpy') if m in sys.modules]
        print(dt, ','.join(sorted(eps)), ','.join(heavy) or '-', len(bs))
        """
    )
    rows = [line.split() for line in _in_fresh_python(code, env, runs)]
    t_list = [float(r[0]) for r in rows]
    heavy = {r[2] for r in rows}
    real = sorted(ep.name for ep in importlib_metadata.entry_points(group="neuropod.backends"))
    print(f"{'import neuropod':<34} median {statistics.median(t_import) * 1e3:7.2f} ms  ({runs} fresh interpreters)")
    print(
        f"{'import + list backends + caps':<34} median {statistics.median(t_list) * 1e3:7.2f} ms  "
        f"entry points: {rows[0][1]} (real: {', '.join(real)}); heavy modules imported: {', '.join(sorted(heavy))}"
    )
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "neuropod", "backends"], env=env, capture_output=True, check=True)
    print(f"{'`neuropod backends` command':<34} {(time.perf_counter() - t0) * 1e3:7.2f} ms wall, with interpreter start")
    ok = statistics.median(t_list) < 0.1 and heavy == {"-"}
    print(f"target listing < 100 ms, no framework imported: {'met' if ok else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="fewer runs, for a smoke test")
    args = ap.parse_args()
    discovery(runs=3 if args.quick else args.runs)


if __name__ == "__main__":
    main()
