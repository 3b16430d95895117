"""Damaged and tampered ``.pt2`` files: a clear error, and no code from inside them runs.

The pickles here, if unpickled, would create a marker directory; each test
checks that it was not created. The tampered files also get a manifest that
matches them (as someone who rewrote the package would write), so what
stops them is the backend's own check, not the manifest's.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import neuropod
from neuropod import cache
from neuropod.errors import BackendError, PackageError
from neuropod.package import MANIFEST, make_manifest
from neuropod.packagers import create_torch_export_neuropod

import models
from conftest import spec

IN, OUT = spec(("x", "float32", ["batch", 4]), ("y", "float32", ["batch", 3])), spec(("out", "float32", ["batch", 3]), ("norm", "float32", ["batch"]))


class _Payload:
    """Unpickling this makes the directory ``path``: proof that code from the pickle ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker), protocol=2)


def evil_torch_file(marker: Path) -> bytes:
    """A file in ``torch.save``'s zip format whose pickle names ``os.mkdir``."""
    import io

    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = evil_pickle(marker)
            dst.writestr(info, data)
    return out.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    examples = {"x": rng.standard_normal((3, 4)).astype(np.float32), "y": rng.standard_normal((3, 3)).astype(np.float32)}
    root = tmp_path_factory.mktemp("exported")
    path: Path = create_torch_export_neuropod(root / "m", "m", IN, OUT, module=models.TwoLayer(), example_inputs=examples)
    return path


def copy_package(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def rewrite_pt2(package: Path, edit: Any) -> None:
    """Rewrite ``0/data/model.pt2`` member by member through ``edit(name, data) -> data | None`` (None drops it;
    ``edit(None, None)`` returns extra members to add), then write a manifest that matches."""
    pt2 = package / "0" / "data" / "model.pt2"
    src = zipfile.ZipFile(pt2)
    members = [(info, src.read(info.filename)) for info in src.infolist()]
    src.close()
    prefix = members[0][0].filename.split("/", 1)[0] + "/"
    with zipfile.ZipFile(pt2, "w", zipfile.ZIP_STORED) as dst:
        for info, data in members:
            new = edit(info.filename[len(prefix) :], data)
            if new is not None:
                dst.writestr(info, new)
        for name, data in (edit(None, None) or {}).items():
            dst.writestr(prefix + name, data)
    fix_manifest(package)


def fix_manifest(package: Path) -> None:
    (package / MANIFEST).write_text(json.dumps(make_manifest(package), indent=2, sort_keys=True) + "\n")


def test_torch_itself_would_run_the_pickle_in_the_sample_inputs(exported: Path, tmp_path: Path) -> None:
    """The threat is real: torch.export.load unpickles a tampered sample-input file with weights_only=False."""
    pkg = copy_package(exported, tmp_path / "tampered")
    marker = tmp_path / "torch-ran-it"
    rewrite_pt2(pkg, lambda name, data: evil_torch_file(marker) if name == "data/sample_inputs/model.pt" else data)
    code = f"import torch\ntry:\n    torch.export.load({str(pkg / '0' / 'data' / 'model.pt2')!r})\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300, check=True)
    assert marker.exists(), "torch.export.load ran the pickle: the check below is what stops it"


def test_tampered_sample_inputs_are_refused_unrun(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "tampered")
    marker = tmp_path / "ran"
    rewrite_pt2(pkg, lambda name, data: evil_torch_file(marker) if name == "data/sample_inputs/model.pt" else data)
    with pytest.raises(PackageError, match=r"sample inputs \(data/sample_inputs/model.pt\) are a pickle that torch's "
                       r"weights-only loader refuses .*weights_only=False, which runs any code it names"):  # fmt: skip
        neuropod.load_neuropod(pkg)
    assert not marker.exists()


def test_pickled_weight_is_refused_unrun(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "tampered")
    marker = tmp_path / "ran"

    def edit(name: str | None, data: bytes | None) -> Any:
        if name == "data/weights/model_weights_config.json":
            config = json.loads(data or b"")
            config["config"]["fc1.weight"]["use_pickle"] = True
            return json.dumps(config).encode()
        if name is not None and name == "data/weights/" + "weight_0":
            return evil_torch_file(marker)
        return data

    rewrite_pt2(pkg, edit)
    with pytest.raises(PackageError, match=r"weight 'fc1.weight' is stored as a pickle .*weights_only=False"):
        neuropod.load_neuropod(pkg)
    assert not marker.exists()


def test_pickled_object_constant_is_refused_unrun(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "tampered")
    marker = tmp_path / "ran"

    def edit(name: str | None, data: bytes | None) -> Any:
        if name is None:
            return {"data/constants/opaque_obj_0": evil_pickle(marker)}
        if name == "data/constants/model_constants_config.json":
            return json.dumps({"config": {"obj": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True}}}).encode()
        return data

    rewrite_pt2(pkg, edit)
    with pytest.raises(PackageError, match=r"constant 'obj' is a pickled Python or TorchBind object \(opaque_obj_0\)"):
        neuropod.load_neuropod(pkg)
    assert not marker.exists()


def test_legacy_pickled_weights_are_refused(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "tampered")
    marker = tmp_path / "ran"
    rewrite_pt2(pkg, lambda name, data: {"data/weights/model.pt": evil_torch_file(marker)} if name is None else data)
    with pytest.raises(PackageError, match=r"stores data/weights/model.pt as one pickle \(the format of torch 2.7 and older\)"):
        neuropod.load_neuropod(pkg)
    assert not marker.exists()


def test_truncated_pt2(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "truncated")
    pt2 = pkg / "0" / "data" / "model.pt2"
    data = pt2.read_bytes()
    pt2.write_bytes(data[: len(data) // 2])
    # The manifest sees it first...
    with pytest.raises(PackageError, match="model.pt2"):
        neuropod.load_neuropod(pkg)
    # ...and with a manifest that matches, the backend's own check.
    fix_manifest(pkg)
    with pytest.raises(PackageError, match=r"0/data/model.pt2 is not a readable .pt2 archive \(truncated or corrupt"):
        neuropod.load_neuropod(pkg)


def test_corrupt_program_inside_a_good_zip(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "corrupt")
    rewrite_pt2(pkg, lambda name, data: b'{"not": "a program"' if name == "models/model.json" else data)
    with pytest.raises(PackageError, match=re.escape("holds a program (models/model.json) that is not JSON")):
        neuropod.load_neuropod(pkg)
    # JSON, but not a program: torch's reader fails, and says so through a BackendError.
    rewrite_pt2(pkg, lambda name, data: b'{"not": "a program"}' if name == "models/model.json" else data)
    with pytest.raises(BackendError, match=re.escape(f"torch {torch.__version__} could not load 0/data/model.pt2")):
        neuropod.load_neuropod(pkg)


def test_a_zip_that_is_not_a_pt2_archive(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "other")
    rewrite_pt2(pkg, lambda name, data: None if name == "archive_format" else data)
    with pytest.raises(PackageError, match="is not a PT2 archive \\(no 'archive_format' saying pt2\\)"):
        neuropod.load_neuropod(pkg)


def test_changed_file_without_a_new_manifest(exported: Path, tmp_path: Path) -> None:
    pkg = copy_package(exported, tmp_path / "changed")
    pt2 = pkg / "0" / "data" / "model.pt2"
    data = bytearray(pt2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt2.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="model.pt2"):
        neuropod.load_neuropod(pkg)
    assert cache.sha256_file(pt2) != json.loads((pkg / MANIFEST).read_text())["files"]["0/data/model.pt2"]


def test_aoti_package_with_a_program_beside_it_is_refused(two_layer_aoti: Path, exported: Path, tmp_path: Path) -> None:
    """An AOTInductor .pt2 that also holds a torch.export program (aoti_load_package would deserialize it)."""
    pkg = copy_package(two_layer_aoti, tmp_path / "aoti")
    program = zipfile.ZipFile(exported / "0" / "data" / "model.pt2")
    extra = {n.split("/", 1)[1]: program.read(n) for n in program.namelist() if "/models/" in n or "/data/sample_inputs/" in n}
    rewrite_pt2(pkg, lambda name, data: extra if name is None else data)
    with pytest.raises(PackageError, match=r"holds torch.export program\(s\) \(model\) beside the compiled model"):
        neuropod.load_neuropod(pkg)
