"""Real custom ops (``torch.library`` in C++, see ``oplib.py``), compiled here with g++ against the installed torch.

The op libraries are built, and the models that call them exported and
compiled, in a subprocess: this test process has never seen the op when a
package loads it, so only the backend's loading of ``0/ops`` before the
program can make it work.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import neuropod
from neuropod.errors import BackendError
from oplib import OpLibraries, run_script

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to compile the custom ops")

PACKAGE = r"""
import sys
import numpy as np
import torch
from neuropod.packagers import create_aoti_neuropod, create_torch_export_neuropod

lib, out = sys.argv[1:3]
torch.ops.load_library(lib)

class UsesOp(torch.nn.Module):
    def forward(self, x):
        return {"y": torch.ops.neuropod_torch_test.scale_plus(x, 3.0)}

x = np.array([0, 1, 2.5, 4], np.float32)
spec_in = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
spec_out = [{"name": "y", "dtype": "float32", "shape": ["n"]}]
common = dict(test_input_data={"x": x}, test_expected_out={"y": x * 3 + 1})
create_torch_export_neuropod(f"{out}/exported", "exported", spec_in, spec_out, module=UsesOp(), custom_ops=[lib], **common)
create_aoti_neuropod(f"{out}/compiled", "compiled", spec_in, spec_out, module=UsesOp(), custom_ops=[lib], **common)
# Packaged without its library: it passes its check here, where the op is loaded already.
create_torch_export_neuropod(f"{out}/without_lib", "without_lib", spec_in, spec_out, module=UsesOp(), **common)
"""


@pytest.fixture(scope="module")
def packaged(op_libraries: OpLibraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uses_op")
    run_script(PACKAGE, op_libraries.test_lib, out)
    return out


X = np.array([0, 1, 2.5, 4, -3], np.float32)


def test_the_op_loads_from_the_package_before_the_program(packaged: Path) -> None:
    assert not hasattr(torch.ops.neuropod_torch_test, "scale_plus"), "this process has not loaded the op"
    # Without the library the program cannot be read: the op is unknown. Nothing is loaded for it.
    with pytest.raises(BackendError, match=r"calls operator\(s\) neuropod_torch_test::scale_plus.default, which torch .* does not have \(custom-op libraries in the package: none\)"):
        neuropod.load_neuropod(packaged / "without_lib")
    for name, platform in (("exported", "torch_export"), ("compiled", "aoti")):
        with neuropod.load_neuropod(packaged / name) as model:
            assert model.backend.platform == platform and type(model).__name__ == "NeuropodModel"
            np.testing.assert_allclose(model.infer({"x": X})["y"], X * 3 + 1)
    with neuropod.load_neuropod(packaged / "without_lib") as model:  # now that the op is here, it runs
        np.testing.assert_allclose(model.infer({"x": X})["y"], X * 3 + 1)
