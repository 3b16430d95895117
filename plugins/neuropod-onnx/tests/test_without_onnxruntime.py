"""neuropod-onnx installed without its [cpu] or [gpu] extra: what a user without onnxruntime reads.

Each check runs in a subprocess whose ``onnxruntime`` import is blocked
(``sys.modules["onnxruntime"] = None``), as it fails for a user who has not
installed it; the plugin and the core are the real ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from neuropod import plugins

BLOCK = "import sys\nsys.modules['onnxruntime'] = None\n"
HINT = plugins.pip_install(plugins.KNOWN_FRAMEWORKS["onnx"])


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], capture_output=True, text=True, timeout=120)


def test_demo_says_onnxruntime_is_missing_and_which_extra_installs_it(tmp_path: Path) -> None:
    # As a new user types it: no platform (onnx's demo is the default).
    done = _run("from neuropod.cli import main\nsys.exit(main(['demo', '--dir', sys.argv[1]]))", str(tmp_path))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("neuropod demo: error: create_onnx_neuropod needs onnxruntime, which is not installed: ")
    assert HINT in last
    assert "unexpected" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "demo_adder.neuropod").exists()


def test_packager_raises_plugin_not_installed(tmp_path: Path) -> None:
    code = (
        "from neuropod.errors import PluginNotInstalledError\n"
        "from neuropod.packagers import create_onnx_neuropod\n"
        "from neuropod_onnx.demo import INPUT_SPEC, OUTPUT_SPEC, demo_model_bytes\n"
        "try:\n"
        "    create_onnx_neuropod(sys.argv[1], 'm', INPUT_SPEC, OUTPUT_SPEC, onnx_model=demo_model_bytes())\n"
        "except PluginNotInstalledError as e:\n"
        "    assert isinstance(e, ImportError) and isinstance(e.__cause__, ModuleNotFoundError)\n"
        "    print(e)\n"
    )
    done = _run(code, str(tmp_path / "m.neuropod"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("create_onnx_neuropod needs onnxruntime, which is not installed: ")
    assert HINT in done.stdout
    assert not (tmp_path / "m.neuropod").exists()


def test_without_the_block_the_same_demo_runs(tmp_path: Path) -> None:
    """The subprocess itself is sound: unblocked, the demo packages and runs its model."""
    code = "from neuropod.cli import main\nsys.exit(main(['demo', 'onnx', '--dir', sys.argv[1]]))"
    done = subprocess.run([sys.executable, "-c", "import sys\n" + code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "demo_adder.neuropod").exists() and "output out" in done.stdout
