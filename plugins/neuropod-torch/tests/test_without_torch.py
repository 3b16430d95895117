"""The plugin installed where torch is not: it loads, offers no backends, and says what to install.

A fresh virtual environment gets the core (with its dependencies) and this
plugin without its dependencies, so torch is absent for real, not hidden.
"""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

import pytest

from neuropod.packagers import create_torch_export_neuropod

import models
from conftest import TWO_LAYER_OUT, XY_SPEC, xy

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("no-torch")
    venv.create(where, with_pip=True)
    python = where / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(ROOT / "core")], check=True, capture_output=True, timeout=600)
    subprocess.run([*pip, "--no-deps", str(ROOT / "plugins" / "neuropod-torch")], check=True, capture_output=True,
                   timeout=600)  # fmt: skip
    return python


CHECK = """
import json, sys
import neuropod_torch, neuropod_torch.packager
from neuropod import plugins
from neuropod.errors import NeuropodError
import neuropod
infos = {i.name: i.distribution for i in plugins.plugin_infos()}
backends = [b.id for b in plugins.installed_backends()]
try:
    neuropod.load_neuropod(sys.argv[1])
    error = None
except NeuropodError as e:
    error = str(e)
print(json.dumps({"plugins": infos, "backends": backends, "error": error, "torch": "torch" in sys.modules}))
"""


def test_plugin_without_torch(python_without_torch: Path, tmp_path: Path) -> None:
    path = create_torch_export_neuropod(tmp_path / "m", "m", XY_SPEC, TWO_LAYER_OUT, module=models.TwoLayer(),
                                        example_inputs=xy(2))  # fmt: skip
    done = subprocess.run([str(python_without_torch), "-c", CHECK, str(path)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plugins"].get("torch_export") == result["plugins"].get("aoti") == "neuropod-torch 0.4.0"
    assert result["backends"] == [] and result["torch"] is False
    assert "neuropod-torch 0.4.0 is installed, but its framework is not: pip install torch" in result["error"]
