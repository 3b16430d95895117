"""Tests for neuropod.devices: NVML reading, host files, device names.

This machine has no NVIDIA driver, so the real NVML path is exercised as the
"CPU host" case. Decoding of NVML results is checked with a small stand-in
``pynvml`` module (NVML is the boundary we cannot cross here, not a framework).
"""

from __future__ import annotations

import json
import sys
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuropod import devices
from neuropod.devices import GPU, Host, load_host, local_host, parse_device, read_nvml
from neuropod.errors import NeuropodError

HOSTS = Path(__file__).parent / "hosts"
GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_local_host() -> Any:
    local_host.cache_clear()
    yield
    local_host.cache_clear()


def _write(tmp_path: Path, data: Any, name: str = "host.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def _gpu(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_total": "80GiB"}
    base.update(fields)
    return base


# --- NVML -------------------------------------------------------------------


def test_real_nvml_on_this_machine_is_a_cpu_host() -> None:
    host = read_nvml()  # no mocking: there is no driver here, and it must not raise
    assert isinstance(host, Host)
    if host.has_gpu:
        pytest.skip("this machine has a GPU after all")
    assert host.name == "this machine"
    assert host.gpus == ()
    assert host.note
    assert "\n" not in host.note
    assert host.source in ("no-nvml", "nvml")
    assert host.describe().startswith("cpu")


class _FakeNVMLError(Exception):
    pass


class _Memory:
    def __init__(self, total: int, free: int) -> None:
        self.total = total
        self.free = free


def _fake_pynvml(
    gpus: list[tuple[Any, Any, tuple[int, int], int, int]],
    *,
    init_error: BaseException | None = None,
    fail_cuda_version: bool = False,
    fail_device: bool = False,
) -> types.ModuleType:
    """A stand-in pynvml; ``calls`` records what was called, to check shutdown."""
    nvml = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    def handle(index: int) -> int:
        if fail_device:
            raise _FakeNVMLError("GPU is lost")
        return index

    def cuda_version() -> int:
        if fail_cuda_version:
            raise _FakeNVMLError("Function Not Found")
        return 12040

    nvml.__dict__.update(
        calls=calls,
        NVMLError=_FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: gpus[h][0],
        nvmlDeviceGetUUID=lambda h: gpus[h][1],
        nvmlDeviceGetCudaComputeCapability=lambda h: gpus[h][2],
        nvmlDeviceGetMemoryInfo=lambda h: _Memory(gpus[h][3], gpus[h][4]),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlSystemGetCudaDriverVersion=cuda_version,
    )
    return nvml


A100 = (b"NVIDIA A100-SXM4-80GB", b"GPU-aaaa", (8, 0), 80 * GIB, 75 * GIB)
T4 = ("Tesla T4", "GPU-bbbb", (7, 5), 15360 * 2**20, 14930 * 2**20)


def test_nvml_results_are_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml([A100, T4])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    host = read_nvml()
    assert host.source == "nvml"
    assert host.note is None
    assert host.driver_version == "550.54.15"
    assert host.cuda_driver_version == "12.4"
    assert host.gpus == (
        GPU(0, "NVIDIA A100-SXM4-80GB", "GPU-aaaa", "8.0", 80 * GIB, 75 * GIB),
        GPU(1, "Tesla T4", "GPU-bbbb", "7.5", 15360 * 2**20, 14930 * 2**20),
    )
    assert host.gpu("cuda:1").cc_tuple == (7, 5)
    assert fake.calls == ["init", "shutdown"]
    assert host.describe().splitlines() == [
        "cuda:0  NVIDIA A100-SXM4-80GB (cc 8.0, 75.0 GiB free of 80.0 GiB)",
        "cuda:1  Tesla T4 (cc 7.5, 14.6 GiB free of 15.0 GiB)",
        "cpu",
    ]


@pytest.mark.parametrize("error", [_FakeNVMLError("Driver Not Loaded"), OSError("libnvidia-ml.so.1: cannot open"),
                                   RuntimeError("weird\nsecond line")])
def test_nvml_init_failure_is_a_cpu_host(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    fake = _fake_pynvml([A100], init_error=error)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    host = read_nvml()
    assert host == Host("this machine", source="no-nvml", note=f"NVML not available: {str(error).splitlines()[0]}")
    assert "shutdown" not in fake.calls  # never shut down what did not start


def test_missing_pynvml_is_a_cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes the import raise ImportError
    host = read_nvml()
    assert not host.has_gpu and host.source == "no-nvml"
    assert host.note is not None and host.note.startswith("NVML not available")


def test_query_failure_after_init_still_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml([A100], fail_device=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    host = read_nvml()
    assert host.source == "no-nvml" and host.note == "NVML query failed: GPU is lost"
    assert fake.calls == ["init", "shutdown"]


def test_missing_cuda_driver_query_keeps_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([T4], fail_cuda_version=True))
    host = read_nvml()
    assert host.has_gpu and host.cuda_driver_version is None and host.driver_version == "550.54.15"


def test_nvml_with_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([]))
    host = read_nvml()
    assert host.source == "nvml" and not host.has_gpu and host.note == "NVML found no GPUs"
    assert host.describe() == "cpu  NVML found no GPUs"


def test_local_host_is_cached_and_uses_the_patched_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    described = load_host(HOSTS / "two-a100.json")
    calls: list[int] = []

    def fake_read() -> Host:
        calls.append(1)
        return described

    monkeypatch.setattr(devices, "read_nvml", fake_read)
    assert local_host() is described
    assert local_host() is described
    assert calls == [1]
    local_host.cache_clear()
    local_host()
    assert calls == [1, 1]


def test_local_host_rereads_a_gpu_host_after_its_max_age(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server that loads models for days must see today's free memory, not its start's.
    gpu_host = load_host(HOSTS / "two-a100.json")
    cpu_host = Host("cpu box", source="no-nvml", note="NVML not available: no driver")
    readings = [gpu_host, replace(gpu_host, gpus=gpu_host.gpus[:1])]
    monkeypatch.setattr(devices, "read_nvml", lambda: readings.pop(0))
    monkeypatch.setattr(devices, "HOST_MAX_AGE", 0.0)
    first = local_host()
    time.sleep(0.01)
    second = local_host()
    assert (len(first.gpus), len(second.gpus)) == (2, 1) and readings == []
    # A host without GPUs is read once: no driver appears while a process runs.
    local_host.cache_clear()
    calls: list[int] = []
    monkeypatch.setattr(devices, "read_nvml", lambda: calls.append(1) or cpu_host)
    assert local_host() is cpu_host and local_host() is cpu_host and calls == [1]


def test_importing_devices_does_not_import_pynvml() -> None:
    import subprocess

    code = "import sys, neuropod.devices; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(Path(devices.__file__).parents[1])})
    assert out.stdout.strip() == "False"


# --- host files -------------------------------------------------------------


def test_two_a100s() -> None:
    host = load_host(HOSTS / "two-a100.json")
    assert host.name == "two A100s"
    assert host.source == str(HOSTS / "two-a100.json")
    assert host.driver_version == "550.54.15" and host.cuda_driver_version == "12.4"
    assert [g.device for g in host.gpus] == ["cuda:0", "cuda:1"]
    assert all(g.memory_total == 80 * GIB and g.cc_tuple == (8, 0) for g in host.gpus)
    assert host.gpu("gpu:1").uuid == "GPU-a81d4c62-7e09-4f35-b2c8-13d9e04f5a67"


def test_one_h100() -> None:
    host = load_host(str(HOSTS / "one-h100.json"))
    (gpu,) = host.gpus
    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.compute_capability == "9.0"
    assert gpu.memory_total == 81559 * 2**20 and gpu.memory_free == 80724 * 2**20
    assert host.gpu("cuda") is gpu


def test_t4() -> None:
    (gpu,) = load_host(HOSTS / "t4.json").gpus
    assert gpu.cc_tuple == (7, 5) and gpu.name == "Tesla T4"
    assert 15 * GIB <= gpu.memory_total <= 16 * 10**9 + 2 * 10**8


def test_laptop_without_gpu() -> None:
    host = load_host(HOSTS / "laptop-cpu.json")
    assert host.name == "laptop without GPU" and not host.has_gpu
    assert host.driver_version is None and host.describe() == "cpu  no GPU"


def test_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, {"gpus": [_gpu(), _gpu(index=3, compute_capability=8.6)]}, name="rack-7.json")
    host = load_host(path)
    assert host.name == "rack-7"
    first, second = host.gpus
    assert first == GPU(0, "NVIDIA A100-SXM4-80GB", "GPU-described-0", "8.0", 80 * GIB, 80 * GIB)
    assert second.index == 3 and second.uuid == "GPU-described-3" and second.compute_capability == "8.6"
    assert load_host(_write(tmp_path, {})).gpus == ()
    nulls = load_host(_write(tmp_path, {"name": None, "gpus": None, "driver_version": None}))
    assert (nulls.name, nulls.gpus, nulls.driver_version) == ("host", (), None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        (0, 0),
        ("80GiB", 80 * GIB),
        ("80 GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TiB", 3 * 2**39),
        ("1.5 tb", 15 * 10**11),
        ("  16gb ", 16 * 10**9),
        ("2048", 2048),
        ("100B", 100),
        ("4KiB", 4096),
        ("4kB", 4000),
    ],
)
def test_memory_units(tmp_path: Path, text: Any, expected: int) -> None:
    host = load_host(_write(tmp_path, {"gpus": [_gpu(memory_total=text, memory_free=0)]}))
    assert host.gpus[0].memory_total == expected


@pytest.mark.parametrize(
    ("value", "expected"), [("8.6", "8.6"), (" 9.0 ", "9.0"), (8.0, "8.0"), (7.5, "7.5"), ([8, 9], "8.9"), ("12.0", "12.0")]
)
def test_compute_capability_forms(tmp_path: Path, value: Any, expected: str) -> None:
    host = load_host(_write(tmp_path, {"gpus": [_gpu(compute_capability=value)]}))
    assert host.gpus[0].compute_capability == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "the top level is [1, 2] but must be an object"),
        ("just text", "the top level is 'just text' but must be an object"),
        ({"nmae": "x", "gpu": []}, "the top level has unknown key(s) 'nmae', 'gpu'; allowed: name, driver_version"),
        ({"gpus": [_gpu(memroy_free="1GiB")]}, "gpus[0] has unknown key(s) 'memroy_free'; allowed: index, name"),
        ({"name": 3}, "name is 3 but must be a non-empty string"),
        ({"name": "  "}, "name is '  ' but must be a non-empty string"),
        ({"name": ""}, "name is '' but must be a non-empty string"),
        ({"driver_version": 550}, "driver_version is 550 but must be a non-empty string"),
        ({"cuda_driver_version": "twelve"}, "cuda_driver_version is 'twelve' but must be a string like \"12.4\""),
        ({"cuda_driver_version": 12.4}, "cuda_driver_version is 12.4 but must be a string"),
        ({"gpus": {"name": "x"}}, "gpus is {'name': 'x'} but must be a list of GPU objects"),
        ({"gpus": ["A100"]}, "gpus[0] is 'A100' but must be an object"),
        ({"gpus": [_gpu(), _gpu(compute_capability="eight")]},
         "gpus[1].compute_capability is 'eight' but must be like \"8.0\""),
        ({"gpus": [_gpu(compute_capability=8)]}, "gpus[0].compute_capability is 8 but must be like"),
        ({"gpus": [_gpu(compute_capability=[8])]}, "gpus[0].compute_capability is [8] but must be like"),
        ({"gpus": [_gpu(compute_capability="8.61")]}, "gpus[0].compute_capability is '8.61'"),
        ({"gpus": [_gpu(compute_capability=[True, 0])]}, "gpus[0].compute_capability is [True, 0]"),
        ({"gpus": [{"name": "x", "memory_total": 1}]}, "gpus[0].compute_capability is missing"),
        ({"gpus": [{"name": "x", "compute_capability": "8.0"}]}, "gpus[0].memory_total is missing"),
        ({"gpus": [{"compute_capability": "8.0", "memory_total": 1}]}, "gpus[0].name is missing"),
        ({"gpus": [_gpu(name=None)]}, "gpus[0].name is None but must be a non-empty string"),
        ({"gpus": [_gpu(uuid=7)]}, "gpus[0].uuid is 7 but must be a non-empty string"),
        ({"gpus": [_gpu(index=-1)]}, "gpus[0].index is -1 but must be a non-negative integer"),
        ({"gpus": [_gpu(index=True)]}, "gpus[0].index is True but must be a non-negative integer"),
        ({"gpus": [_gpu(index="0")]}, "gpus[0].index is '0' but must be a non-negative integer"),
        ({"gpus": [_gpu(), _gpu(index=0)]}, "gpus[1].index is 0, used by an earlier GPU"),
        ({"gpus": [_gpu(memory_total=-5)]}, "gpus[0].memory_total is -5 but must be a non-negative number of bytes"),
        ({"gpus": [_gpu(memory_free=-1)]}, "gpus[0].memory_free is -1 but must be a non-negative number of bytes"),
        ({"gpus": [_gpu(memory_total="-5GiB")]}, "gpus[0].memory_total is '-5GiB' but must be bytes or a size like"),
        ({"gpus": [_gpu(memory_total="80 gigs")]}, "gpus[0].memory_total is '80 gigs'"),
        ({"gpus": [_gpu(memory_total="80G")]}, "gpus[0].memory_total is '80G'"),
        ({"gpus": [_gpu(memory_total=8.5e10)]}, "gpus[0].memory_total is 85000000000.0"),
        ({"gpus": [_gpu(memory_total=True)]}, "gpus[0].memory_total is True"),
        ({"gpus": [_gpu(memory_free="81GiB")]},
         f"gpus[0].memory_free ({81 * GIB} bytes) is more than memory_total ({80 * GIB} bytes)"),
    ],
)
def test_bad_host_files(tmp_path: Path, data: Any, message: str) -> None:
    path = _write(tmp_path, json.dumps(data), name="a100.json")
    with pytest.raises(NeuropodError) as caught:
        load_host(path)
    assert str(caught.value).startswith(f"Host file {str(path)!r}: ")
    assert message in str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(NeuropodError, match=r"Host file '.*nope\.json' does not exist"):
        load_host(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(NeuropodError, match="cannot be read"):
        load_host(tmp_path)


def test_invalid_json_says_where(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "name": "x",\n  "gpus": [,]\n}')
    with pytest.raises(NeuropodError, match="not valid JSON: Expecting value at line 3 column 12"):
        load_host(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(NeuropodError, match="cannot be read"):
        load_host(path)


def test_huge_values_are_shortened_in_messages(tmp_path: Path) -> None:
    with pytest.raises(NeuropodError) as caught:
        load_host(_write(tmp_path, {"name": ["x" * 1000]}))
    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("name", ["two-a100.json", "one-h100.json", "laptop-cpu.json", "t4.json"])
def test_to_dict_round_trips_through_a_file(tmp_path: Path, name: str) -> None:
    host = load_host(HOSTS / name)
    copy = load_host(_write(tmp_path, host.to_dict()))
    assert copy.gpus == host.gpus
    assert (copy.name, copy.driver_version, copy.cuda_driver_version) == (
        host.name, host.driver_version, host.cuda_driver_version)
    assert copy.source == str(tmp_path / "host.json")


def test_nvml_host_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([A100, T4]))
    host = read_nvml()
    assert load_host(_write(tmp_path, host.to_dict())).gpus == host.gpus
    assert json.loads(json.dumps(host.to_dict())) == host.to_dict()


# --- device names -----------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [("cpu", "cpu"), ("CPU", "cpu"), ("cuda", "cuda:0"), ("cuda:0", "cuda:0"), ("cuda:3", "cuda:3"),
     ("gpu", "cuda:0"), ("GPU", "cuda:0"), ("gpu:1", "cuda:1"), ("CUDA:2", "cuda:2"), (" cuda:1 ", "cuda:1")],
)
def test_parse_device(given: str, expected: str) -> None:
    assert parse_device(given) == expected


@pytest.mark.parametrize("bad", ["", "tpu", "cuda:", "cuda:-1", "cuda:x", "cuda0", "cpu:0", "mps", "cuda:٣"])
def test_parse_device_rejects(bad: str) -> None:
    with pytest.raises(NeuropodError) as caught:
        parse_device(bad)
    assert repr(bad) in str(caught.value)
    assert '"cpu", "cuda", "cuda:N", "gpu", "gpu:N"' in str(caught.value)


def test_host_gpu_errors_list_the_devices() -> None:
    host = load_host(HOSTS / "two-a100.json")
    with pytest.raises(NeuropodError, match=r"Device cuda:2 is not on this host; host 'two A100s' has: cpu, cuda:0, cuda:1"):
        host.gpu("cuda:2")
    with pytest.raises(NeuropodError, match=r"Device cuda:5 \(from 'gpu:5'\) is not on this host"):
        host.gpu("gpu:5")
    with pytest.raises(NeuropodError, match=r"Device cpu is not a GPU; host 'two A100s' has: cpu, cuda:0, cuda:1"):
        host.gpu("cpu")
    with pytest.raises(NeuropodError, match="Unknown device 'tpu:0'"):
        host.gpu("tpu:0")
    with pytest.raises(NeuropodError, match="has: cpu$"):
        load_host(HOSTS / "laptop-cpu.json").gpu("cuda")


def test_dataclasses_are_frozen() -> None:
    gpu = GPU(0, "x", "GPU-x", "8.0", 1, 1)
    with pytest.raises(AttributeError):
        gpu.index = 1  # type: ignore[misc]
    assert not hasattr(gpu, "__dict__")


# --- anything a user might write -----------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # Mostly valid fields, so whole GPUs get through and the success path is fuzzed too.
    return st.integers(0, 4).flatmap(lambda roll: _json if roll == 4 else valid)


_near_valid_gpu = st.fixed_dictionaries(
    {"name": _mostly(st.sampled_from(["NVIDIA L4", "Tesla T4"])),
     "compute_capability": _mostly(st.sampled_from(["8.9", 8.9, [8, 9], "7.5"])),
     "memory_total": _mostly(st.sampled_from(["24GB", 24 * 10**9, "22.5GiB", "1.5 TiB"]))},
    optional={"memory_free": _mostly(st.sampled_from(["1GiB", 0, "512 MB"])),
              "uuid": _mostly(st.just("GPU-1234")), "index": _mostly(st.integers(0, 3))},
)
_host_like = st.fixed_dictionaries(
    {}, optional={"name": _mostly(st.just("box")), "driver_version": _mostly(st.just("550.54.15")),
                  "cuda_driver_version": _mostly(st.just("12.4")),
                  "gpus": st.one_of(st.lists(_near_valid_gpu, max_size=3), st.lists(_near_valid_gpu | _json, max_size=3), _json)},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_json | _host_like)
def test_any_json_loads_or_raises_neuropod_error(tmp_path: Path, data: Any) -> None:
    path = _write(tmp_path, json.dumps(data))
    try:
        host = load_host(path)
    except NeuropodError as error:
        assert str(error).startswith("Host file ")
        return
    assert isinstance(host, Host)
    assert all(0 <= g.memory_free <= g.memory_total for g in host.gpus)
    host.describe()
    json.dumps(host.to_dict())
