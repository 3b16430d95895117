"""Reliability of the package format and the extraction cache (issue 11).

Each test names the issue item it covers. A package either loads the model
it was built from or fails with one PackageError that says why: never the
wrong model, a raw traceback, a hang, or files left behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuropod.errors import PackageError
from neuropod.package import parse_config, read_package, write_package


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache that the code under test creates."""
    path = tmp_path / "cache-parent" / "neuropod-cache"
    path.parent.mkdir()
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(path))
    monkeypatch.delenv("NEUROPOD_MAX_PACKAGE_BYTES", raising=False)
    monkeypatch.delenv("NEUROPOD_MAX_PACKAGE_FILES", raising=False)
    return path


def _config(name: str, **extra: Any) -> Any:
    data = {
        "name": name,
        "platform": "onnx",
        "input_spec": [{"name": "x", "dtype": "float32", "shape": [None]}],
        "output_spec": [{"name": "y", "dtype": "float32", "shape": [None]}],
        "exported_with": {"neuropod": "0.4.0"},
    }
    data.update(extra)
    return parse_config(data, "test config")


def _payload(name: str, size: int = 4096) -> bytes:
    """Model bytes that identify the model they belong to."""
    return hashlib.sha256(name.encode()).digest() * (size // 32)


def _package(dest: Path, name: str, *, as_zip: bool = True, **kwargs: Any) -> Path:
    return write_package(dest, _config(name), {"0/data/model.bin": _payload(name)}, package_as_zip=as_zip, **kwargs)


def _model_of(pkg: Any) -> tuple[str, bytes]:
    return pkg.name, (pkg.data_dir / "model.bin").read_bytes()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry(cache: Path, pkg: Any) -> Path:
    """The cache entry a zip package was loaded from (whatever the layout inside it)."""
    return cache / "packages" / pkg.root.relative_to(cache / "packages").parts[0]


def _leftovers(cache: Path) -> list[str]:
    packages = cache / "packages"
    return sorted(p.name for p in packages.iterdir()) if packages.exists() else []


def _run_python(code: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


# --- 1. a zip swapped while it is loaded never poisons the cache -----------------

_SWAPPER = """
import os, sys, time
a, b, target, stop = sys.argv[1:5]
tmp = target + ".swap"
deadline = time.monotonic() + 30
while not os.path.exists(stop) and time.monotonic() < deadline:
    for src in (a, b):
        os.link(src, tmp)
        os.replace(tmp, target)  # a no-op when both name one file: then tmp stays
        if os.path.exists(tmp):
            os.unlink(tmp)
"""


def test_1_zip_swapped_during_loads_never_poisons_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = {}
    for name in ("model_a", "model_b"):
        models[name] = _package(tmp_path / f"{name}.zip", name)
    expected = {name: (name, _payload(name)) for name in models}
    target = tmp_path / "deployed.zip"
    os.link(models["model_a"], target)
    stop = tmp_path / "stop"
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(models["model_a"]), str(models["model_b"]),
                                str(target), str(stop)])
    try:
        loads = 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            # A fresh cache each time, so that every load of the swapped path extracts.
            monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / f"cache-{loads}"))
            got = _model_of(read_package(target))
            assert got in expected.values()  # one model, whole: its name and its data agree
            for name, path in models.items():  # the entry each zip's hash leads to holds that zip's model
                assert _model_of(read_package(path)) == expected[name], f"cache poisoned after {loads} loads"
            loads += 1
        assert swapper.poll() is None, "the swapper stopped early"
        assert loads > 20
    finally:
        stop.touch()
        swapper.wait(timeout=30)


# --- 2. a modified cache entry is not trusted -----------------------------------


def test_2_modified_entry_with_matching_manifest_is_not_served(tmp_path: Path, cache: Path) -> None:
    zpath = _package(tmp_path / "good.zip", "good")
    pkg = read_package(zpath)
    model = pkg.data_dir / "model.bin"
    later = model.stat().st_mtime_ns + 10**9
    evil = _payload("evil")  # the same size as the good model
    model.write_bytes(evil)
    manifest = json.loads((pkg.root / "manifest.json").read_text())
    manifest["files"]["0/data/model.bin"] = hashlib.sha256(evil).hexdigest()
    (pkg.root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for path in (model, pkg.root / "manifest.json"):
        os.utime(path, ns=(later, later))  # an edit made a second later
    assert read_package(pkg.root).manifest == manifest["files"]  # the entry is self-consistent

    again = read_package(zpath)
    assert _model_of(again) == ("good", _payload("good"))
    assert again.manifest is not None and again.manifest["0/data/model.bin"] == hashlib.sha256(
        _payload("good")).hexdigest()


def test_2_cache_directory_is_private(tmp_path: Path, cache: Path) -> None:
    read_package(_package(tmp_path / "good.zip", "good"))
    assert cache.stat().st_mode & 0o777 == 0o700
    assert (cache / "packages").stat().st_mode & 0o777 == 0o700


def test_2_verify_cache_finds_and_repairs_a_change_the_stat_check_cannot_see(tmp_path: Path, cache: Path) -> None:
    from neuropod.package import verify_cache

    zpath = _package(tmp_path / "good.zip", "good")
    other = read_package(_package(tmp_path / "other.zip", "other"))
    pkg = read_package(zpath)
    assert verify_cache() == []
    model = pkg.data_dir / "model.bin"
    st = model.stat()
    model.write_bytes(_payload("evil"))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as they were

    problems = verify_cache()
    assert len(problems) == 1
    assert str(_entry(cache, pkg)) in problems[0] and "0/data/model.bin" in problems[0]
    assert _entry(cache, pkg).exists()  # reporting changes nothing
    repaired = verify_cache(repair=True)
    assert len(repaired) == 1 and repaired[0].endswith("(removed)")
    assert not _entry(cache, pkg).exists() and _entry(cache, other).exists()
    assert verify_cache() == []
    assert _model_of(read_package(zpath)) == ("good", _payload("good"))
    assert verify_cache() == []


def test_2_verify_cache_removes_stale_temporaries_and_foreign_entries(cache: Path, tmp_path: Path) -> None:
    from neuropod.package import verify_cache

    read_package(_package(tmp_path / "good.zip", "good"))
    stale = cache / "packages" / ".extract-killed"
    (stale / "files").mkdir(parents=True)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    fresh = cache / "packages" / ".extract-running"  # perhaps another process, right now
    fresh.mkdir()
    foreign = cache / "packages" / "not-an-entry"
    foreign.write_text("x")
    problems = verify_cache(repair=True)
    assert sorted(p.split(":")[0] for p in problems) == sorted([str(stale), str(foreign)])
    assert not stale.exists() and not foreign.exists() and fresh.exists()


# --- 11. damaged zips -----------------------------------------------------------


def _member_data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _damaged(zpath: Path, member: str, method: int, error: type[BaseException]) -> Path:
    """A copy of a zip with bytes flipped inside one member's compressed data, so that
    the decompressor (not the CRC check) fails with `error`, as zipfile itself shows."""
    with zipfile.ZipFile(zpath) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for name, data in members:
            zf.writestr(name, data)
    raw = buf.getvalue()
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        info = zf.getinfo(member)
    start = _member_data_offset(raw, info)
    for pos in range(start, start + info.compress_size - 8):
        damaged = bytearray(raw)
        for k in range(8):
            damaged[pos + k] ^= 0xFF
        try:
            with zipfile.ZipFile(io.BytesIO(bytes(damaged))) as zf:
                zf.read(member)
        except error:  # never a BadZipFile (a CRC error), which is not one of these
            out = zpath.with_name(f"damaged-{method}.zip")
            out.write_bytes(bytes(damaged))
            return out
        except (zipfile.BadZipFile, zlib.error, lzma.LZMAError, OSError, EOFError, ValueError):
            continue  # a failure of another kind (a CRC error): try the next position
    raise AssertionError(f"no flip makes {member} fail with {error.__name__}")


@pytest.mark.parametrize(
    ("method", "error"),
    [
        pytest.param(zipfile.ZIP_DEFLATED, "zlib.error", id="deflate"),
        pytest.param(zipfile.ZIP_LZMA, "lzma.LZMAError", id="lzma"),
        pytest.param(zipfile.ZIP_BZIP2, "OSError", id="bzip2"),
    ],
)
def test_11_damaged_member_names_package_and_member(tmp_path: Path, cache: Path, method: int, error: str) -> None:
    errors = {"zlib.error": zlib.error, "lzma.LZMAError": lzma.LZMAError, "OSError": OSError}
    zpath = _damaged(_package(tmp_path / "good.zip", "good"), "0/data/model.bin", method, errors[error])
    with pytest.raises(PackageError, match=r"damaged-\d+\.zip .*'0/data/model\.bin'") as err:
        read_package(zpath)
    assert str(zpath) in str(err.value)
    assert not [n for n in _leftovers(cache) if not n.startswith(".trash")]


def test_11_truncated_zip(tmp_path: Path, cache: Path) -> None:
    zpath = _package(tmp_path / "good.zip", "good")
    cut = tmp_path / "cut.zip"
    cut.write_bytes(zpath.read_bytes()[: zpath.stat().st_size // 2])
    with pytest.raises(PackageError, match=r"cut\.zip is not a readable zip package"):
        read_package(cut)
    assert _leftovers(cache) == []


@pytest.fixture(scope="module")
def fuzz_zip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    work = tmp_path_factory.mktemp("fuzz")
    zpath = write_package(work / "m.zip", _config("fuzzed"), {"0/data/model.bin": bytes(range(256)) * 20,
                                                               "0/data/notes.txt": b"hello " * 50},
                          test_input_data={"x": np.arange(4.0), "s": np.array(["a", "bb"])}, package_as_zip=True)
    return zpath.read_bytes()


def test_11_a_member_without_a_name_is_refused(tmp_path: Path, cache: Path) -> None:
    """A damaged central directory can hold a member whose name is empty (found by the fuzz below)."""
    zpath = tmp_path / "nameless.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr(zipfile.ZipInfo(""), b"data")
    with pytest.raises(PackageError, match=r"member '' has no file name"):
        read_package(zpath)
    assert [n for n in _leftovers(cache) if n.startswith(".")] == []


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8),
       st.none() | st.floats(0, 1))
def test_11_damaged_zip_fuzz(tmp_path: Path, cache: Path, fuzz_zip: bytes, flips: list[tuple[float, int]],
                             cut: float | None) -> None:
    """Any damage gives a PackageError or, where it missed every byte that matters, the right model."""
    data = bytearray(fuzz_zip)
    for where, value in flips:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    zpath = tmp_path / "fuzzed.zip"
    zpath.write_bytes(bytes(data))
    try:
        pkg = read_package(zpath)
    except PackageError as e:
        assert str(zpath) in str(e)
    else:
        assert (pkg.name, (pkg.data_dir / "model.bin").read_bytes()) == ("fuzzed", bytes(range(256)) * 20)
    assert [n for n in _leftovers(cache) if n.startswith(".")] == []  # nothing half-made stays in the cache


# --- 12. directory packages: regular files only, never a hang ----------------------

_LOAD = """
import sys
from neuropod.errors import PackageError
from neuropod.package import read_package
try:
    pkg = read_package(sys.argv[1])
    if pkg.has_test_data:
        pkg.test_data()
    print("LOADED")
except PackageError as e:
    print("PackageError:", e)
"""


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link_to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _link_inside(path: Path) -> None:
    path.rename(path.with_name("real.bin"))
    path.symlink_to("real.bin")


@pytest.mark.parametrize(
    ("rel", "make", "kind"),
    [
        pytest.param("0/data/model.bin", _fifo, "FIFO", id="fifo-model"),
        pytest.param("0/data/model.bin", _link_to_dev_zero, r"symbolic link \(to '/dev/zero'\)", id="dev-zero"),
        pytest.param("config.json", _fifo, "FIFO", id="fifo-config"),
        pytest.param("test_data/inputs.npz", _fifo, "FIFO", id="fifo-test-data"),
        pytest.param("0/data/model.bin", _link_inside, "symbolic link", id="link-inside-package"),
    ],
)
def test_12_special_files_in_a_directory_package_are_refused(tmp_path: Path, rel: str, make: Any,
                                                             kind: str) -> None:
    pkg = _package(tmp_path / "pkg", "good", as_zip=False, test_input_data={"x": np.ones(2, np.float32)})
    make(pkg / rel)
    start = time.monotonic()
    try:
        out = _run_python(_LOAD, str(pkg), timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading a package with {kind} at {rel} hung")
    assert time.monotonic() - start < 20
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PackageError:"), out.stdout
    assert str(pkg / rel) in out.stdout
    assert re.search(kind, out.stdout), out.stdout


def test_12_package_without_manifest_with_a_fifo_is_refused_in_process(tmp_path: Path) -> None:
    """An original 0.3 package has no manifest to hash: the scan still refuses the FIFO, at once."""
    pkg = write_package(tmp_path / "legacy", parse_config(
        {"name": "legacy", "platform": "onnx", "input_spec": [], "output_spec": []}, "c"),
        {"0/data/model.bin": b"m"})
    (pkg / "manifest.json").unlink()
    os.mkfifo(pkg / "0" / "data" / "weights")
    with pytest.raises(PackageError, match=r"0/data/weights is a FIFO"):
        read_package(pkg)


# --- 13. archive limits and cleanup ----------------------------------------------


def _many_files_zip(path: Path, count: int, *, with_config: bool = True) -> Path:
    files = {"0/data/model.bin": _payload("many"), **{f"0/data/extra/{i}.txt": b"x" for i in range(count)}}
    good = write_package(path.with_name("base.zip"), _config("many"), files, package_as_zip=True)
    if with_config:
        return good.rename(path)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for info in src.infolist():
            if info.filename != "config.json":
                zf.writestr(info.filename, src.read(info))
    return path


def test_13_member_count_is_capped(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zpath = _many_files_zip(tmp_path / "many.zip", 50)
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_FILES", "20")
    with pytest.raises(PackageError, match=r"many\.zip has 5\d members, more than the 20 allowed.*"
                                           r"NEUROPOD_MAX_PACKAGE_FILES"):
        read_package(zpath)
    assert _leftovers(cache) in ([], ["locks"])
    monkeypatch.delenv("NEUROPOD_MAX_PACKAGE_FILES")
    with pytest.raises(PackageError, match=r"more than the 30 allowed"):
        read_package(zpath, max_files=30)
    assert not (cache / "packages").exists() or [n for n in _leftovers(cache) if n != "locks"] == []


def test_13_rejected_zip_leaves_no_files_in_the_cache(tmp_path: Path, cache: Path) -> None:
    """A zip that extracts fine but is not a package (no config.json) leaves nothing behind."""
    zpath = _many_files_zip(tmp_path / "not-a-package.zip", 300, with_config=False)
    with pytest.raises(PackageError, match=r"not a Neuropod package"):
        read_package(zpath)
    assert [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "locks"] == []


def test_13_path_too_deep_is_refused_before_extraction(tmp_path: Path, cache: Path) -> None:
    zpath = _many_files_zip(tmp_path / "deep.zip", 0)
    with zipfile.ZipFile(zpath, "a") as zf:
        zf.writestr("0/data/" + "d/" * 1500 + "f", b"x")  # within PATH_MAX, past the recursion limit
    with pytest.raises(PackageError, match=r"deep\.zip holds a path 1503 levels deep"):
        read_package(zpath)
    assert [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "locks"] == []


def test_13_interrupt_mid_extraction_leaves_nothing(tmp_path: Path, cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    zpath = _many_files_zip(tmp_path / "many.zip", 20)
    real_read = zipfile.ZipExtFile.read
    calls = 0

    def interrupted(self: zipfile.ZipExtFile, n: int = -1) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 10:
            raise KeyboardInterrupt
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        read_package(zpath)
    assert [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "locks"] == []
    monkeypatch.setattr(zipfile.ZipExtFile, "read", real_read)
    assert read_package(zpath).name == "many"


# --- 14. damaged cache entries are repaired on the next load ----------------------


def _entry_is_a_file(entry: Path, root: Path) -> None:
    shutil.rmtree(entry)
    entry.write_text("not a directory")


def _entry_is_empty(entry: Path, root: Path) -> None:
    shutil.rmtree(entry)
    entry.mkdir()


def _file_deleted(entry: Path, root: Path) -> None:
    (root / "0" / "data" / "model.bin").unlink()


def _manifest_deleted(entry: Path, root: Path) -> None:
    (root / "manifest.json").unlink()


def _file_added(entry: Path, root: Path) -> None:
    (root / "0" / "data" / "extra.bin").write_bytes(b"extra")


def _entry_is_a_link(entry: Path, root: Path) -> None:
    shutil.rmtree(entry)
    entry.symlink_to(root.anchor)


@pytest.mark.parametrize("damage", [_entry_is_a_file, _entry_is_empty, _file_deleted, _manifest_deleted,
                                    _file_added, _entry_is_a_link])
def test_14_damaged_entry_is_repaired_on_next_load(tmp_path: Path, cache: Path, damage: Any) -> None:
    zpath = _package(tmp_path / "good.zip", "good")
    first = read_package(zpath)
    entry = _entry(cache, first)
    damage(entry, first.root)
    again = read_package(zpath)
    assert _model_of(again) == ("good", _payload("good"))
    assert again.root == first.root and entry.is_dir() and not entry.is_symlink()
    assert read_package(again.root).manifest == again.manifest  # the repaired entry is whole
    assert [n for n in _leftovers(cache) if not n.startswith(".")] == [entry.name]


# --- 17. deep JSON -----------------------------------------------------------------


@pytest.mark.parametrize("rel", ["config.json", "manifest.json", "0/config.json"])
@pytest.mark.parametrize("as_zip", [False, True], ids=["dir", "zip"])
def test_17_deeply_nested_json_then_a_good_load(tmp_path: Path, rel: str, as_zip: bool) -> None:
    good = _package(tmp_path / "good", "good", as_zip=False, backend_config={"a": 1})
    bad = _package(tmp_path / "bad", "bad", as_zip=False, backend_config={"a": 1})
    (bad / rel).write_text("[" * 100_000 + "]" * 100_000)
    if as_zip:
        from neuropod.package import write_zip

        write_zip(bad, tmp_path / "bad.zip")
        bad = tmp_path / "bad.zip"
    with pytest.raises(PackageError, match=rf"{rel}.*nests more than \d+ levels deep"):
        read_package(bad, verify=False)
    assert _model_of(read_package(good)) == ("good", _payload("good"))


# --- 18. two writers of one path -----------------------------------------------------

_WRITER = """
import os, sys, time
from neuropod.errors import PackageError
from neuropod.package import parse_config, write_package
base, name, kind, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
config = parse_config({"name": name, "platform": "onnx", "input_spec": [], "output_spec": [],
                       "exported_with": {"neuropod": "0.4.0"}}, "c")
payload = name.encode() * (2**20 // len(name))
for r in range(rounds):
    print("READY", flush=True)
    while not os.path.exists(f"{base}/go-{r}"):
        time.sleep(0.0005)
    dest = f"{base}/round-{r}/" + ("pkg.zip" if kind == "zip" else "pkg")
    try:
        write_package(dest, config, {"0/data/model.bin": payload}, package_as_zip=kind == "zip")
        print("OK", flush=True)
    except PackageError as e:
        print("PackageError:", e, flush=True)
    except BaseException as e:
        print("RAW", type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("kind", ["zip", "dir"])
def test_18_two_processes_write_one_path(tmp_path: Path, cache: Path, kind: str) -> None:
    rounds = 3  # the race needs both writers past the "does it exist" check; give it a few chances
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), name, kind, str(rounds)],
                                stdout=subprocess.PIPE, text=True)
               for name in ("writer_one", "writer_two")]
    try:
        for r in range(rounds):
            out_dir = tmp_path / f"round-{r}"
            out_dir.mkdir()
            dest = out_dir / ("pkg.zip" if kind == "zip" else "pkg")
            for w in writers:
                assert w.stdout is not None and w.stdout.readline().strip() == "READY"
            (tmp_path / f"go-{r}").touch()
            results = [w.stdout.readline().strip() for w in writers if w.stdout is not None]
            assert sorted(r.split(":")[0] for r in results) == ["OK", "PackageError"], results
            loser = next(r for r in results if r.startswith("PackageError"))
            assert f"{dest} already exists" in loser
            winner = ("writer_one", "writer_two")[[r == "OK" for r in results].index(True)]
            pkg = read_package(dest)
            assert pkg.name == winner
            assert (pkg.data_dir / "model.bin").read_bytes() == winner.encode() * (2**20 // len(winner))
            assert sorted(p.name for p in out_dir.iterdir()) == [dest.name]  # no temporary left behind
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
            w.communicate()


# --- 19. NUL characters in string test data ------------------------------------------


@pytest.mark.parametrize("value", ["c\x00", b"c\x00", "\x00"], ids=["str", "bytes", "only-nul"])
def test_19_trailing_nul_in_test_strings_is_refused(tmp_path: Path, value: Any) -> None:
    words = np.empty(3, dtype=object)
    words[:] = ["a", "b", value]
    with pytest.raises(PackageError, match=r"Test tensor 'words' .*element \[2\] ends with a NUL"):
        _package(tmp_path / "out" / "pkg", "strings", as_zip=False, test_input_data={"words": words})
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written


def test_19_interior_nul_round_trips_exactly(tmp_path: Path) -> None:
    values = ["a\x00b", "\x00lead", "plain", ""]
    pkg = read_package(_package(tmp_path / "pkg", "strings", as_zip=False,
                                test_input_data={"words": np.array(values, dtype=object)}))
    inputs, _ = pkg.test_data()
    assert inputs["words"].tolist() == values


def test_19_test_string_bytes_that_are_not_utf8_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match=r"Test tensor 'raw' .*element \[1\] is bytes that are not UTF-8"):
        _package(tmp_path / "pkg", "strings", as_zip=False,
                 test_input_data={"raw": np.array([b"ok", b"\xff\xfe"], dtype=object)})


# --- 21. manifest, config and limit leniency -------------------------------------------


@pytest.mark.parametrize(("version", "hint"), [(2, "newer neuropod"), (0, "damaged"), ("1", "damaged"),
                                               (True, "damaged"), (1.0, "damaged"), (None, "damaged")])
def test_21_unknown_manifest_version(tmp_path: Path, version: Any, hint: str) -> None:
    pkg = _package(tmp_path / "pkg", "good", as_zip=False)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["manifest_version"] = version
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=rf"manifest\.json: manifest_version {re.escape(json.dumps(version))} "
                                           rf"is not one this neuropod reads: it reads manifest_version 1 only"
                                           rf".*{hint}"):
        read_package(pkg, verify=False)


@pytest.mark.parametrize("value", [{}, "", 0, False, "libfoo.so", {"a": 1}, [1]])
def test_21_custom_ops_must_be_a_list(tmp_path: Path, value: Any) -> None:
    pkg = _package(tmp_path / "pkg", "good", as_zip=False)
    config = json.loads((pkg / "config.json").read_text())
    config["custom_ops"] = value
    (pkg / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackageError, match=r"'custom_ops' must be a list of file names"):
        read_package(pkg, verify=False)


@pytest.mark.parametrize("value", ["", [], 0, False, "GPU"])
def test_21_input_tensor_device_must_be_an_object(value: Any) -> None:
    with pytest.raises(PackageError, match=r"'input_tensor_device' must map input names"):
        _config("x", input_tensor_device=value)


@pytest.mark.parametrize("var", ["NEUROPOD_MAX_PACKAGE_BYTES", "NEUROPOD_MAX_PACKAGE_FILES"])
@pytest.mark.parametrize("value", ["-5", "0", "1e3", "abc", "1.5", "10GB"])
def test_21_bad_limit_in_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    zpath = _package(tmp_path / "good.zip", "good")
    monkeypatch.setenv(var, value)
    unit = "bytes" if var.endswith("BYTES") else "files"
    with pytest.raises(PackageError, match=rf"{var} must be a whole number of {unit} greater than 0 .*'{value}'"):
        read_package(zpath)


@pytest.mark.parametrize("arg", ["max_bytes", "max_files"])
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-5, ValueError), (1.5, TypeError),
                                              (True, TypeError), ("100", TypeError)])
def test_21_bad_limit_argument(tmp_path: Path, arg: str, value: Any, error: type[Exception]) -> None:
    zpath = _package(tmp_path / "good.zip", "good")
    with pytest.raises(error, match=arg):
        read_package(zpath, **{arg: value})



def test_2_cache_verify_command(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuropod.cli import main

    pkg = read_package(_package(tmp_path / "good.zip", "good"))
    out = io.StringIO()
    assert main(["cache", "verify"], out=out) == 0
    assert "every entry matches its record" in out.getvalue()
    model = pkg.data_dir / "model.bin"
    st = model.stat()
    model.write_bytes(_payload("evil"))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = io.StringIO()
    assert main(["cache", "verify"], out=out) == 1
    assert "1 problem(s)" in out.getvalue() and "0/data/model.bin" in out.getvalue() and "--repair" in out.getvalue()
    out = io.StringIO()
    assert main(["cache", "verify", "--repair"], out=out) == 0
    assert "(removed)" in out.getvalue()
    assert main(["cache", "verify"], out=io.StringIO()) == 0
    assert _model_of(read_package(tmp_path / "good.zip")) == ("good", _payload("good"))
