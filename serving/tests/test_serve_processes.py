"""``neuropod serve --processes N`` as a real command: N server processes on shared ports.

Each test starts the real command (``python -m neuropod serve --processes 2``)
on free ports over the adder and echo ONNX packages, and talks to it with
tritonclient (HTTP and gRPC) and httpx, opening new connections so that the
kernel spreads them over both processes. Which process holds a connection is
read from /proc (the socket's inode in the process's descriptors); which
processes are the server's, from the parent's descendants.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from sequence_models import simple_sequence_package  # noqa: E402

from conftest import adder_and_echo, alive, descendants, free_port, private_caches  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreading and /proc")


@pytest.fixture(scope="module")
def repo() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-serve-processes-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        yield root
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class _Group:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    http: int
    grpc: int
    metrics: int

    def logs(self) -> str:
        return f"stdout:\n{self.out.read_text(errors='replace')}\nstderr:\n{self.err.read_text(errors='replace')}"

    def servers(self) -> list[int]:
        """The pids of the server processes (the parent's spawned children, not its resource tracker)."""
        found = []
        for pid in sorted(descendants(self.proc.pid)):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                found.append(pid)
        return found


def _start(repo: Path, tmp: Path, *extra: str, processes: str = "2") -> _Group:
    ports = [free_port() for _ in range(3)]
    out, err = tmp / "stdout", tmp / "stderr"
    cmd = [sys.executable, "-m", "neuropod", "serve", str(repo / "models"), "--processes", processes,
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *extra]  # fmt: skip
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=dict(os.environ))
    group = _Group(proc, out, err, *ports)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"neuropod serve exited with {proc.returncode} before it was ready:\n{group.logs()}")
        try:
            if httpx.get(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=1).status_code == 200:
                return group
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"neuropod serve was not ready within 60 s:\n{group.logs()}")
        time.sleep(0.1)


def _stop(group: _Group, sig: int = signal.SIGTERM) -> float:
    """Signal the parent and wait for it; how long it took."""
    t0 = time.monotonic()
    group.proc.send_signal(sig)
    try:
        group.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        group.proc.kill()
        group.proc.wait()
        pytest.fail(f"neuropod serve --processes did not exit within 30 s of {sig!r}:\n{group.logs()}")
    return time.monotonic() - t0


def _gone(pids: list[int], within: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to ``within`` seconds for them to go."""
    deadline = time.monotonic() + within
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def group(repo: Path) -> Iterator[_Group]:
    tmp = Path(tempfile.mkdtemp(prefix="neuropod-group-", dir=repo))
    served = _start(repo, tmp)
    try:
        yield served
    finally:
        servers = served.servers()
        _stop(served)
        assert served.proc.returncode == 0, served.logs()
        assert not _gone(servers), "server processes left behind"


def _infer_http(client: object, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    inputs = [httpclient.InferInput(n, list(a.shape), "FP32") for n, a in (("x", x), ("y", y))]
    inputs[0].set_data_from_numpy(x, binary_data=True)
    inputs[1].set_data_from_numpy(y, binary_data=False)
    result = client.infer("adder", inputs)  # type: ignore[attr-defined]
    return np.asarray(result.as_numpy("out"))


def _infer_grpc(client: object, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    inputs = [grpcclient.InferInput(n, list(a.shape), "FP32") for n, a in (("x", x), ("y", y))]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = client.infer("adder", inputs)  # type: ignore[attr-defined]
    return np.asarray(result.as_numpy("out"))


def _requests_total(text: str, model: str, protocol: str) -> float:
    found = re.search(rf'^neuropod_requests_total\{{model="{model}",protocol="{protocol}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _metrics(group: _Group, port: int | None = None) -> str:
    r = httpx.get(f"http://127.0.0.1:{port or group.metrics}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _accepted_on(port: int) -> set[str]:
    """Inodes of the established TCP connections whose local port is ``port`` (the server's ends)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            found.add(fields[9])
    return found


def test_both_processes_answer_over_rest_and_grpc(group: _Group) -> None:
    rng = np.random.default_rng(0)
    before = _metrics(group)
    sent = {"rest": 0, "grpc": 0}
    # Connections held open at once: the kernel spreads them over the processes by their ports.
    held = []
    try:
        for i in range(24):
            x, y = (rng.standard_normal((i % 4 + 1, 2)).astype(np.float32) for _ in range(2))
            client = httpclient.InferenceServerClient(f"127.0.0.1:{group.http}")
            held.append(client)
            np.testing.assert_allclose(_infer_http(client, x, y), x + y, rtol=1e-6)
            sent["rest"] += 1
        for _ in range(8):
            x, y = (rng.standard_normal((2, 2)).astype(np.float32) for _ in range(2))
            with grpcclient.InferenceServerClient(f"127.0.0.1:{group.grpc}") as client:
                assert client.is_server_ready()
                np.testing.assert_allclose(_infer_grpc(client, x, y), x + y, rtol=1e-6)
            sent["grpc"] += 1
        accepted = _accepted_on(group.http)
        servers = group.servers()
        assert len(servers) == 2, servers
        per_process = {pid: len(_socket_inodes(pid) & accepted) for pid in servers}
    finally:
        for client in held:
            client.close()
    assert sum(per_process.values()) == 24, per_process
    assert all(n > 0 for n in per_process.values()), f"every connection went to one process: {per_process}"
    after = _metrics(group)
    for protocol, n in sent.items():
        assert _requests_total(after, "adder", protocol) - _requests_total(before, "adder", protocol) == n, protocol


def test_metrics_are_the_sum_over_processes(group: _Group) -> None:
    x = np.ones((1, 2), np.float32)
    before = _requests_total(_metrics(group), "adder", "rest")
    for _ in range(10):  # each on a new connection: some to each process
        with httpx.Client(timeout=10) as http:
            body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 2], "data": x.ravel().tolist()}
                               for n in ("x", "y")]}  # fmt: skip
            assert http.post(f"http://127.0.0.1:{group.http}/v2/models/adder/infer", json=body).status_code == 200
    for port in (group.metrics, group.http):  # the metrics port and /metrics on the REST port alike
        for _ in range(4):  # whichever process answers the scrape
            text = _metrics(group, port)
            assert _requests_total(text, "adder", "rest") == before + 10
            assert "neuropod_server_processes 2.0" in text
            assert "neuropod_models_loaded 2.0" in text
            count = re.search(
                r'^neuropod_request_duration_seconds_count\{model="adder",protocol="rest"\} (\S+)$', text, re.M
            )
            assert count is not None and float(count.group(1)) == before + 10
            inf = re.search(r'^neuropod_request_duration_seconds_bucket\{le="\+Inf",model="adder",protocol="rest"\} (\S+)$',
                            text, re.M)  # fmt: skip
            assert inf is not None and float(inf.group(1)) == before + 10, text


def test_repository_unload_and_load_apply_to_every_process(group: _Group) -> None:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{group.grpc}") as client:
        client.unload_model("echo")
    try:
        for _ in range(12):  # new connections, both processes
            with httpclient.InferenceServerClient(f"127.0.0.1:{group.http}") as client:
                assert not client.is_model_ready("echo")
            assert httpx.get(f"http://127.0.0.1:{group.http}/v2/models/echo", timeout=10).status_code == 404
        for _ in range(4):
            with grpcclient.InferenceServerClient(f"127.0.0.1:{group.grpc}") as client:
                assert not client.is_model_ready("echo")
        assert "neuropod_models_loaded 1.0" in _metrics(group)
        # Unloading it again fails in every process alike: the client gets the one answer.
        r = httpx.post(f"http://127.0.0.1:{group.http}/v2/repository/models/echo/unload", timeout=10)
        assert r.status_code == 404 and "echo" in r.json()["error"], r.text
    finally:
        r = httpx.post(f"http://127.0.0.1:{group.http}/v2/repository/models/echo/load", timeout=60)
        assert r.status_code == 200, r.text
    for _ in range(12):
        with httpclient.InferenceServerClient(f"127.0.0.1:{group.http}") as client:
            assert client.is_model_ready("echo")
    with grpcclient.InferenceServerClient(f"127.0.0.1:{group.grpc}") as client:
        assert client.is_model_ready("echo")
    r = httpx.post(f"http://127.0.0.1:{group.http}/v2/repository/models/nope/load", timeout=60)
    assert r.status_code == 404 and "no package named 'nope'" in r.json()["error"], r.text


def test_a_second_group_on_the_same_ports_is_refused(group: _Group, repo: Path) -> None:
    """SO_REUSEPORT would let a second group share the ports silently: the parent's plain bind refuses it."""
    for flag, port in (("--http-port", group.http), ("--grpc-port", group.grpc), ("--metrics-port", group.metrics)):
        ports = {"--http-port": str(free_port()), "--grpc-port": "0", "--metrics-port": "0", flag: str(port)}
        err = _fails(repo, "--processes", "2", *(x for kv in ports.items() for x in kv))
        assert f"{flag} {port}" in err and "already in use" in err, err


def test_sigterm_stops_every_process(repo: Path, tmp_path: Path) -> None:
    served = _start(repo, tmp_path, "--workers", "2", "--quiet")
    with httpclient.InferenceServerClient(f"127.0.0.1:{served.http}") as client:
        x = np.ones((2, 2), np.float32)
        np.testing.assert_allclose(_infer_http(client, x, x), 2 * x)
    family = sorted(descendants(served.proc.pid))
    assert len(served.servers()) == 2
    # Each process runs each model in 2 OPE workers of its own.
    workers = [p for p in family if b"neuropod.ope.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(workers) == 2 * 2 * 2, workers
    took = _stop(served)
    assert served.proc.returncode == 0, served.logs()
    assert took < 20
    assert not _gone(family), "processes left behind after SIGTERM"
    # The port is free again: a plain bind works.
    with socket.socket() as s:
        s.bind(("127.0.0.1", served.http))


def test_a_process_that_dies_stops_the_group(repo: Path, tmp_path: Path) -> None:
    served = _start(repo, tmp_path)
    servers = served.servers()
    os.kill(servers[0], signal.SIGKILL)
    try:
        served.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        pytest.fail(f"the parent did not exit after a server process died:\n{served.logs()}")
    assert served.proc.returncode == 1, served.logs()
    assert f"server process 0 (pid {servers[0]}) exited" in served.err.read_text(), served.logs()
    assert not _gone(servers), "a server process outlived its group"


def test_server_processes_stop_when_the_parent_is_killed(repo: Path, tmp_path: Path) -> None:
    served = _start(repo, tmp_path)
    servers = served.servers()
    served.proc.kill()
    served.proc.wait()
    assert not _gone(servers, within=20), "server processes outlived their killed parent"


def test_quick_model_in_workers_is_warned_about(repo: Path, tmp_path: Path) -> None:
    served = _start(repo, tmp_path, "--workers", "2", processes="1")
    x = np.ones((1, 2), np.float32)
    with httpclient.InferenceServerClient(f"127.0.0.1:{served.http}") as client:
        for _ in range(60):  # the first 50 runs are timed
            _infer_http(client, x, x)
    _stop(served)
    err = served.err.read_text()
    warnings = [line for line in err.splitlines() if "--workers 2 costs more than it gives" in line]
    assert len(warnings) == 1, served.logs()
    assert "model 'adder' runs in" in warnings[0] and "means of its first 50 runs" in warnings[0]
    assert "--processes" in warnings[0]
    assert "'echo'" not in err  # never ran: nothing to judge


def _fails(repo: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "neuropod", "serve", str(repo / "models"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "serving" not in r.stdout, (r.stdout, r.stderr)
    return r.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ray"], "--processes 2 cannot be combined with --ray"),
        (["--allow-client-shm"], "--allow-client-shm cannot be combined with --processes 2"),
    ],
)
def test_options_that_cannot_combine_are_refused(repo: Path, args: list[str], says: str) -> None:
    err = _fails(repo, "--processes", "2", "--http-port", str(free_port()), *args)
    assert says in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_processes_takes_a_number_or_auto(repo: Path, value: str) -> None:
    err = _fails(repo, "--processes", value)
    assert "--processes" in err, err


def test_a_port_in_use_fails_the_start_before_any_process(repo: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _fails(repo, "--processes", "2", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0")
    assert f"--http-port {port}" in err and "already in use" in err, err


def test_a_bad_package_fails_the_start(tmp_path: Path) -> None:
    (tmp_path / "models" / "broken").mkdir(parents=True)
    (tmp_path / "models" / "broken" / "config.json").write_text("{not json")
    err = _fails(tmp_path, "--processes", "2", "--http-port", str(free_port()), "--grpc-port", "0",
                 "--metrics-port", "0")  # fmt: skip
    assert "config.json" in err, err


def test_processes_auto_is_the_usable_cpus() -> None:
    from neuropod_serving.cli import _processes

    assert _processes("auto") == len(os.sched_getaffinity(0))
    assert _processes("3") == 3


def test_merge_families_sums_counters_and_histograms_and_keeps_the_smallest_gauge() -> None:
    from neuropod_serving.processes import merge_families
    from neuropod_serving.server.metrics import ServerMetrics

    a, b = ServerMetrics(), ServerMetrics()
    a.request("m", "rest", 0.001)
    a.request("m", "rest", 0.3, failure="client")
    b.request("m", "rest", 0.002)
    b.request("other", "grpc", 0.002)
    a.loaded(2)
    b.loaded(1)
    merged = {f.name: f for f in merge_families([a.families(), b.families()])}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in merged.values() for s in f.samples}
    assert samples[("neuropod_requests_total", (("model", "m"), ("protocol", "rest")))] == 3
    assert samples[("neuropod_requests_total", (("model", "other"), ("protocol", "grpc")))] == 1
    assert (
        samples[("neuropod_request_failures_total", (("model", "m"), ("protocol", "rest"), ("reason", "client")))] == 1
    )
    key = ("neuropod_request_duration_seconds_bucket", (("le", "0.001"), ("model", "m"), ("protocol", "rest")))
    assert samples[key] == 1
    key = ("neuropod_request_duration_seconds_bucket", (("le", "0.0025"), ("model", "m"), ("protocol", "rest")))
    assert samples[key] == 2
    assert samples[("neuropod_request_duration_seconds_count", (("model", "m"), ("protocol", "rest")))] == 3
    assert samples[("neuropod_request_duration_seconds_sum", (("model", "m"), ("protocol", "rest")))] == pytest.approx(
        0.303
    )
    assert samples[("neuropod_models_loaded", ())] == 1
    assert samples[("neuropod_server_processes", ())] == 2


def test_worker_run_watch_weighs_the_round_trip_against_the_run(caplog: pytest.LogCaptureFixture) -> None:
    from neuropod_serving.server.metrics import WATCHED_RUNS, WorkerRunWatch

    # What the workers report: calls and seconds in the backend; 'quick' runs 10 us, 'slow' 5 ms.
    reported = {"quick": [0, 0.0], "slow": [0, 0.0], "inproc": None}

    def run_time(name: str) -> tuple[int, float] | None:
        r = reported[name]
        return None if r is None else (r[0], r[1])

    watch = WorkerRunWatch(run_time, workers=4)
    with caplog.at_level("WARNING", logger="neuropod_serving.server"):
        for _ in range(WATCHED_RUNS + 5):
            for name, run, seen in (("quick", 10e-6, 300e-6), ("slow", 5e-3, 5.3e-3), ("inproc", 0, 1e-5)):
                if reported[name] is not None:
                    reported[name][0] += 1  # type: ignore[index]
                    reported[name][1] += run  # type: ignore[index]
                watch.observe(name, seen)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert warned[0].startswith("model 'quick' runs in 10 us in its worker processes, but a run takes 300 us"), warned
    assert "round trip to a worker costs 290 us" in warned[0] and "--workers 4" in warned[0]


def test_ready_and_metrics_of_a_process_follow_its_parent(repo: Path) -> None:
    """A server process's app against a parent played by this test over a real pipe: ready only once
    the parent says the group is, and /metrics is what the parent answers."""
    import multiprocessing
    import threading

    from neuropod_serving.processes import GroupMember
    from neuropod_serving.server import Engine, ModelRegistry, create_app
    from neuropod_serving.server.metrics import ServerMetrics

    from conftest import serve_in_thread

    parent, child = multiprocessing.Pipe()
    member = GroupMember(child, 0)
    engine = Engine(ModelRegistry.load([repo / "models"]), metrics=ServerMetrics())
    engine.group = member
    member.attach(engine)
    try:
        with serve_in_thread(create_app(engine)) as port:
            base = f"http://127.0.0.1:{port}"
            r = httpx.get(f"{base}/v2/health/ready")
            assert (r.status_code, r.json()) == (503, {"ready": False})
            parent.send(("ready", True))
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/v2/health/ready").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            scraped: dict[str, httpx.Response] = {}
            scrape = threading.Thread(target=lambda: scraped.update(r=httpx.get(f"{base}/metrics", timeout=10)))
            scrape.start()
            assert parent.poll(10)
            kind, ident, what, _ = parent.recv()
            assert (kind, what) == ("ask", "metrics")
            parent.send(("reply", ident, True, b"neuropod_server_processes 2.0\n"))
            scrape.join(10)
            assert scraped["r"].status_code == 200 and scraped["r"].text == "neuropod_server_processes 2.0\n"
            # The parent asks for this process's own metrics: its families.
            parent.send(("ask", 7, "metrics", None))
            assert parent.poll(10)
            reply = parent.recv()
            assert reply[:3] == ("reply", 7, True) and {f.name for f in reply[3]} >= {"neuropod_requests"}
            parent.send(("ready", False))
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/v2/health/ready").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        member.stopping()  # the parent's end closing is then no reason to stop this (pytest's) process
        parent.close()
        engine.close()


def test_a_stateful_model_is_refused_with_several_processes(tmp_path: Path) -> None:
    # A sequence's state lives in one process, and the kernel spreads requests over them.
    simple_sequence_package(tmp_path / "models")
    err = _fails(tmp_path, "--processes", "2", "--http-port", str(free_port()), "--grpc-port", "0",
                 "--metrics-port", "0")  # fmt: skip
    assert "is stateful" in err and "--processes 1" in err and "--ray" in err, err
