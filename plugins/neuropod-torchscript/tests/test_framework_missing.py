"""neuropod-torchscript installed where torch is not: its packager and its demo say what to install.

Each check runs in a subprocess whose ``torch`` import is blocked
(``sys.modules["torch"] = None``), as it fails for a user who has not
installed it; the plugin and the core are the real ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CODE = """
import sys
sys.modules["torch"] = None
from neuropod.errors import PluginNotInstalledError
from neuropod_torchscript.demo import build_demo
from neuropod_torchscript.packager import create_torchscript_neuropod
where = sys.argv[1]
spec = [{"name": "x", "dtype": "float32", "shape": [2]}]
for call in (lambda: create_torchscript_neuropod(where + "/a", "m", spec, spec, module=object()),
             lambda: build_demo(where)):
    try:
        call()
    except PluginNotInstalledError as e:
        assert isinstance(e.__cause__, ModuleNotFoundError), repr(e.__cause__)
        print(e)
    else:
        print("no error")
"""


def test_packager_and_demo_say_torch_is_missing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "create_torchscript_neuropod needs torch, which is not installed: pip install torch",
        "neuropod demo torchscript needs torch, which is not installed: pip install torch",
    ]
    assert list(tmp_path.iterdir()) == []
