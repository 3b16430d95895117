"""neuropod-tensorflow installed where tensorflow is not: its packager and its demo say what to install.

Each check runs in a subprocess whose ``tensorflow`` import is blocked
(``sys.modules["tensorflow"] = None``), as it fails for a user who has not
installed it; the plugin and the core are the real ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from neuropod import plugins

CODE = """
import sys
sys.modules["tensorflow"] = None
from neuropod.errors import PluginNotInstalledError
from neuropod_tensorflow.demo import build_demo
where = sys.argv[1]
spec = [{"name": "x", "dtype": "float32", "shape": [2]}]
for call in (lambda: build_demo(where),):
    try:
        call()
    except PluginNotInstalledError as e:
        assert isinstance(e.__cause__, ModuleNotFoundError), repr(e.__cause__)
        print(e)
    else:
        print("no error")
"""


def test_packager_and_demo_say_tensorflow_is_missing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "neuropod demo tensorflow needs tensorflow, which is not installed: "
        + plugins.pip_install(plugins.KNOWN_FRAMEWORKS["tensorflow"]),
    ]
    assert list(tmp_path.iterdir()) == []
