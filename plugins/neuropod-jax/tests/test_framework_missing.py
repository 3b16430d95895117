"""neuropod-jax installed where jax is not: its packager and its demo say what to install.

Each check runs in a subprocess whose ``jax`` import is blocked
(``sys.modules["jax"] = None``), as it fails for a user who has not
installed it; the plugin and the core are the real ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import sys
sys.modules["jax"] = None
from neuropod.errors import PluginNotInstalledError
from neuropod_jax.demo import build_demo
from neuropod_jax.packager import create_jax_neuropod
where = sys.argv[1]
spec = [{"name": "x", "dtype": "float32", "shape": [2]}]
for call in (lambda: create_jax_neuropod(where + "/a", "m", spec, spec, fn=abs),
             lambda: build_demo(where)):
    try:
        call()
    except PluginNotInstalledError as e:
        assert isinstance(e.__cause__, ModuleNotFoundError), repr(e.__cause__)
        print(e)
    else:
        print("no error")
"""


def test_packager_and_demo_say_jax_is_missing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "create_jax_neuropod needs jax, which is not installed: pip install jax ('jax[cuda12]' or 'jax[cuda13]' "
        "for NVIDIA GPUs)",
        "neuropod demo jax needs jax, which is not installed: pip install jax ('jax[cuda12]' or 'jax[cuda13]' "
        "for NVIDIA GPUs)",
    ]
    assert list(tmp_path.iterdir()) == []
