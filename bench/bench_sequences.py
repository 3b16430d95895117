"""Stateful models: what a sequence step adds to a model's call, and sequence batching, in one run.

    python bench/bench_sequences.py [--calls 2000] [--rounds 21] [--rounds-gru 15] [--seconds 3]
        [--rounds-serve 3] [--vocab 256 10000] [--protocols grpc http] [--no-serve] [--serve-on ARGS]
        [--serve-off ARGS] [--quick] [--json PATH] [--strict]

1. The added cost of a sequence step, in process, on a tiny model: an ONNX accumulator
   (``y = acc_in + x``, ``acc_out = y``; float32 [1, 4]) packaged with ``state_spec`` (``acc_out`` ->
   ``acc_in``) and run as ``seq.infer({"x": x})`` in ``with model.sequence() as seq``, against its
   stateless twin (the same graph, no ``state_spec``) run as ``model.infer({"x": x, "acc_in": state})``
   by a caller that keeps the state itself (``state = out["acc_out"]``). Per-call means of ``--calls``
   calls, the two sides interleaved over ``--rounds`` rounds; medians, their difference (what the
   sequence adds per step) and ratio. Target: <= 3 us added.
2. Sequence batching of 32 concurrent sequences of a GRU step model, packaged with ``torch.export``:
   an embedding (``--vocab`` tokens x 128), ``GRUCell(128, 512)``, a projection 512 -> ``--vocab``
   logits; token int64 [batch, 1], hidden state float32 [batch, 512] as ``state_spec``; untrained
   (seed 0). Two vocabularies by default: 256 (a character model: the GRU cell is most of a
   step's work) and 10,000 (a word model: the projection is).

   * in process: one ``infer_sequences`` call running a step of each of the 32 sequences, against
     32 ``infer(..., sequence_id=...)`` calls, one per sequence; steps per second, medians over
     ``--rounds-gru`` rounds, and their ratio;
   * through ``neuropod serve``, over gRPC and over REST (``--protocols``), 32 client threads
     (tritonclient.grpc or tritonclient.http, one client each),
     each running one sequence (``sequence_start`` on its first request, ``sequence_end`` on its
     last) as fast as the server answers, for ``--seconds`` seconds: steps per second with sequence
     batching on (``--serve-on``, default ``--max-batch-size 32``, no queue delay: Triton's default
     for the oldest strategy) against off (``--serve-off``, default: no options), the CPU the server
     and the clients used, and the server's steps per run of the model (its statistics). Both
     servers run at once, driven in turn, ``--rounds-serve`` rounds alternating the order. The
     first three steps of every sequence are checked against the same sequence run in process
     (batching must not mix sequences' states).

   Target: batched >= 3 x unbatched throughput.

The server is pinned to CPU core 0 and this process (the clients) to core 1 where taskset and two
cores allow; torch runs with one thread on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

import _common
import neuropod
from _servers import free_port_pair, log_tail, stop_group, wait_ready
from neuropod.sequences import SequenceStep

ADDED_TARGET_US = 3.0
BATCHING_TARGET = 3.0
SEQUENCES = 32
EMBED, HIDDEN = 128, 512
#: Vocabularies measured: a character model and a word model (the projection is most of its work).
VOCABS = (256, 10_000)
SERVER_CORE, CLIENT_CORE = 0, 1
GRU = "gru"
DEFAULT_ON = "--max-batch-size 32"
#: Both servers' options: an idle limit of 30 s, as a step's wait in the server's queue counts as
#: its sequence's idle time (on a busy machine, unbatched, it can pass the default 1 s).
SERVE_COMMON = ["--max-sequence-idle-us", "30000000"]


# --- 1. the added cost of a step ------------------------------------------------


def accumulator_packages(tmp: Path) -> tuple[Path, Path]:
    """The stateful accumulator and its stateless twin: one ONNX graph, packaged twice."""
    from onnx import TensorProto, helper

    from neuropod.packagers import create_onnx_neuropod

    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "acc_in"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])],
        "acc",
        [vi("x", f, ["batch", 4]), vi("acc_in", f, ["batch", 4])],
        [vi("y", f, ["batch", 4]), vi("acc_out", f, ["batch", 4])],
    )
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_model.ir_version = 8
    spec_in = [{"name": n, "dtype": "float32", "shape": ["batch", 4]} for n in ("x", "acc_in")]
    spec_out = [{"name": n, "dtype": "float32", "shape": ["batch", 4]} for n in ("y", "acc_out")]
    stateful = create_onnx_neuropod(tmp / "acc", "acc", spec_in, spec_out, onnx_model=onnx_model,
                                    state_spec=[{"input_name": "acc_in", "output_name": "acc_out"}])  # fmt: skip
    stateless = create_onnx_neuropod(tmp / "acc_plain", "acc_plain", spec_in, spec_out, onnx_model=onnx_model)
    return stateful, stateless


def interleaved(sides: dict[str, Any], calls: int, rounds: int) -> dict[str, list[float]]:
    """Per-call seconds of each side, one mean of ``calls`` calls per round, the order rotating."""
    names = list(sides)
    for name in names:  # warm up
        _common.per_call(sides[name], calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_common.per_call(sides[name], calls))
    return times


def step_cost(tmp: Path, calls: int, rounds: int) -> dict[str, float]:
    stateful, stateless = accumulator_packages(tmp)
    x = np.full((1, 4), 0.5, np.float32)
    with neuropod.load_neuropod(stateful) as model, neuropod.load_neuropod(stateless) as twin:
        box = {"state": np.zeros((1, 4), np.float32)}

        def plain() -> None:  # the caller carries the state itself
            box["state"] = twin.infer({"x": x, "acc_in": box["state"]})["acc_out"]

        with model.sequence() as seq:
            times = interleaved({"plain": plain, "step": lambda: seq.infer({"x": x})}, calls, rounds)
            # both sides added x at every call: the states agree
            np.testing.assert_allclose(seq.state()["acc_in"], box["state"])
    plain_s, step_s = statistics.median(times["plain"]), statistics.median(times["step"])
    added = statistics.median(s - p for s, p in zip(times["step"], times["plain"]))
    ratio = statistics.median(s / p for s, p in zip(times["step"], times["plain"]))
    print(f"tiny ONNX accumulator, per call ({rounds} interleaved rounds x {calls} calls, medians):")
    print(f"  stateless twin, model.infer with the state passed by hand   {plain_s * 1e6:8.2f} us")
    print(f"  stateful, seq.infer (the state kept by neuropod)            {step_s * 1e6:8.2f} us")
    print(f"  added by the sequence step                                  {added * 1e6:8.2f} us   ratio {ratio:.3f}")
    result = {"raw": plain_s, "neuropod": step_s, "overhead": added, "ratio": ratio}
    _common.record("sequence step over the plain call (tiny ONNX)", "seq_step_added",
                   method=f"median of {rounds} interleaved rounds of {calls} calls", **result)  # fmt: skip
    _common.verdict(f"a sequence step adds <= {ADDED_TARGET_US:g} us", added * 1e6 <= ADDED_TARGET_US,
                    f"{added * 1e6:.2f} us", key="seq_step_added")  # fmt: skip
    return result


# --- 2. sequence batching of a GRU step model -------------------------------------


def gru_package(tmp: Path, vocab: int) -> Path:
    """The GRU step model over ``vocab`` tokens, untrained (seed 0), as a torch.export package."""
    import torch

    from neuropod.packagers import create_torch_export_neuropod

    class CharGRU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, EMBED)
            self.cell = torch.nn.GRUCell(EMBED, HIDDEN)
            self.head = torch.nn.Linear(HIDDEN, vocab)

        def forward(self, token: Any, h_in: Any) -> dict[str, Any]:
            h = self.cell(self.embed(token[:, 0]), h_in)
            return {"logits": self.head(h), "h_out": h}

    torch.manual_seed(0)
    spec_in = [{"name": "token", "dtype": "int64", "shape": ["batch", 1]},
               {"name": "h_in", "dtype": "float32", "shape": ["batch", HIDDEN]}]  # fmt: skip
    spec_out = [{"name": "logits", "dtype": "float32", "shape": ["batch", vocab]},
                {"name": "h_out", "dtype": "float32", "shape": ["batch", HIDDEN]}]  # fmt: skip
    example = {"token": np.array([[1], [2]], np.int64), "h_in": np.zeros((2, HIDDEN), np.float32)}
    return create_torch_export_neuropod(
        tmp / f"repo{vocab}" / GRU, GRU, spec_in, spec_out, module=CharGRU(), example_inputs=example,
        state_spec=[{"input_name": "h_in", "output_name": "h_out"}],
    )  # fmt: skip


def tokens(steps: int, vocab: int) -> np.ndarray:
    """The token each sequence sends at each step: [steps, SEQUENCES]."""
    return np.random.default_rng(1).integers(0, vocab, (steps, SEQUENCES), dtype=np.int64)


def in_process(package: Path, vocab: int, rounds: int) -> dict[str, float]:
    toks = tokens(1, vocab)[0]
    with neuropod.load_neuropod(package) as model:
        assert model.sequence_batching, model.sequence_batching_problem
        ids = list(range(1, SEQUENCES + 1))
        model.infer_sequences({"token": toks[:, None]}, [SequenceStep(i, start=True) for i in ids])
        steps = [SequenceStep(i) for i in ids]

        def batched() -> None:
            model.infer_sequences({"token": toks[:, None]}, steps)

        def unbatched() -> None:
            for i, t in zip(ids, toks):
                model.infer({"token": np.array([[t]], np.int64)}, sequence_id=i)

        times = interleaved({"unbatched": unbatched, "batched": batched}, 5, rounds)
        for i in ids:
            model.infer({"token": np.array([[0]], np.int64)}, sequence_id=i, sequence_end=True)
    un, ba = statistics.median(times["unbatched"]), statistics.median(times["batched"])
    ratio = statistics.median(u / b for u, b in zip(times["unbatched"], times["batched"]))
    print(
        f"GRU step model (hidden {HIDDEN}, vocabulary {vocab}), {SEQUENCES} sequences, in process ({rounds} rounds, medians):"
    )
    print(f"  {SEQUENCES} infer(sequence_id=...) calls   {un * 1e3:8.3f} ms   {SEQUENCES / un:9.0f} steps/s")
    print(f"  one infer_sequences call       {ba * 1e3:8.3f} ms   {SEQUENCES / ba:9.0f} steps/s   ratio {ratio:.2f}x")
    result = {"unbatched": un, "batched": ba, "ratio": ratio}
    _common.record(
        f"{SEQUENCES} GRU sequences (vocabulary {vocab}) in process, batched vs unbatched",
        f"seq_gru{vocab}_in_process",
        **result,
    )
    _common.verdict(f"in process, batched >= {BATCHING_TARGET:g}x unbatched", ratio >= BATCHING_TARGET,
                    f"{ratio:.2f}x", key=f"seq_gru{vocab}_in_process")  # fmt: skip
    return result


def expected_logits(package: Path, vocab: int, steps: int) -> np.ndarray:
    """[steps, SEQUENCES, vocab]: every sequence's first ``steps`` steps, run in process."""
    toks = tokens(steps, vocab)
    out = np.empty((steps, SEQUENCES, vocab), np.float32)
    with neuropod.load_neuropod(package) as model:
        for s in range(SEQUENCES):
            with model.sequence() as seq:
                for k in range(steps):
                    out[k, s] = seq.infer({"token": toks[k, s : s + 1, None]})["logits"][0]
    return out


class Server:
    """``neuropod serve`` of the model repository in a process group of its own, pinned to core 0."""

    def __init__(self, label: str, repo: Path, options: list[str], port: int, log: Path):
        self.label, self.port, self.log = label, port, log
        pinned = ["taskset", "-c", str(SERVER_CORE)] if shutil.which("taskset") else []
        command = [sys.executable, "-m", "neuropod", "serve", str(repo), "--http-port", str(port),
                   "--grpc-port", str(port + 1), "--metrics-port", "0", "--quiet", *SERVE_COMMON, *options]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*pinned, *command], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)  # fmt: skip
        urls = [f"http://127.0.0.1:{port}/v2/health/ready", f"http://127.0.0.1:{port}/v2/models/{GRU}/ready"]
        try:
            wait_ready(self.proc, label, log, urls, 180.0)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_group(self.proc)

    def counts(self) -> tuple[int, int]:
        """The model's (inference_count, execution_count) so far: steps, and runs of the model."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/models/{GRU}/stats", timeout=10) as r:
            stats = json.load(r)["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])

    def cpu(self) -> float:
        """CPU seconds (user + system) the server process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(protocol: str, port: int, seconds: float, expected: np.ndarray) -> tuple[float, int, float]:
    """32 client threads, one sequence each, for ``seconds`` over ``protocol`` ("grpc" or "http",
    at ``port``): (steps per second, steps, seconds)."""
    if protocol == "grpc":
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module  # type: ignore[no-redef]

    checked, vocab = expected.shape[0], expected.shape[2]
    toks = tokens(checked, vocab)
    counts = [0] * SEQUENCES
    errors: list[BaseException] = []
    barrier = threading.Barrier(SEQUENCES + 1)
    stop = threading.Event()

    def one(s: int) -> None:
        client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            token = client_module.InferInput("token", [1, 1], "INT64")
            wanted = [client_module.InferRequestedOutput("logits")]
            barrier.wait()
            k = 0
            while True:
                last = stop.is_set()
                token.set_data_from_numpy(toks[k % checked, s : s + 1, None])
                result = client.infer(GRU, [token], outputs=wanted, sequence_id=s + 1, sequence_start=k == 0,
                                      sequence_end=last)  # fmt: skip
                if k < checked:
                    np.testing.assert_allclose(result.as_numpy("logits")[0], expected[k, s], rtol=1e-4, atol=1e-5)
                k += 1
                if last:
                    break
            counts[s] = k
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            stop.set()
            if not barrier.broken:
                barrier.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in range(SEQUENCES)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"a client failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    total = sum(counts)
    return total / elapsed, total, elapsed


PROTOCOLS = {"grpc": "gRPC", "http": "REST"}


def served(
    tmp: Path, package: Path, vocab: int, seconds: float, rounds: int, on: list[str], off: list[str],
    protocols: list[str],
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Both servers up at once (the idle one costs nothing), driven in turn: ``rounds`` rounds of a
    cell each (protocol x batching), the order of on and off alternating, so a change in the
    machine's load meets both alike. Medians of the rounds; the ratio is the median of theirs."""
    expected = expected_logits(package, vocab, 3)
    print(f"  through neuropod serve, {SEQUENCES} tritonclient threads, one sequence each "
          f"({rounds} rounds of {seconds:g} s per cell, medians):")  # fmt: skip
    servers: dict[str, Server] = {}
    cells: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    try:
        for label, options in (("off", off), ("on", on)):
            port = free_port_pair()
            servers[label] = Server(f"neuropod serve, sequence batching {label}", package.parent, options, port,
                                    tmp / f"{label}{vocab}.log")  # fmt: skip
        for r in range(-1, rounds):  # round -1: warm-up (and the check of every sequence's first steps)
            for protocol in protocols:
                for label in ("off", "on") if r % 2 else ("on", "off"):
                    server = servers[label]
                    at = server.port + 1 if protocol == "grpc" else server.port
                    if r < 0:
                        drive(protocol, at, min(1.0, seconds), expected)
                        continue
                    cpu0, client0, counts0 = server.cpu(), time.process_time(), server.counts()
                    rate, _total, elapsed = drive(protocol, at, seconds, expected)
                    server_cores = (server.cpu() - cpu0) / elapsed
                    client_cores = (time.process_time() - client0) / elapsed
                    counts = server.counts()
                    runs = counts[1] - counts0[1]
                    per_run = (counts[0] - counts0[0]) / runs if runs else float("nan")
                    cells.setdefault((protocol, label), []).append((rate, server_cores, client_cores, per_run))
    except BaseException:
        for server in servers.values():
            print(f"{server.label}: its log ends:\n{log_tail(server.log)}")
        raise
    finally:
        for server in servers.values():
            server.stop()
    results: dict[str, dict[str, float]] = {}
    for protocol in protocols:
        name = PROTOCOLS[protocol]
        for label, options in (("off", off), ("on", on)):
            rate, server_cores, client_cores, per_run = (statistics.median(c) for c in zip(*cells[protocol, label]))
            print(f"    {name:<5} batching {label:<3} ({' '.join(options) or 'no options'}): {rate:7.0f} steps/s "
                  f"(CPU: server {server_cores:.2f}, clients {client_cores:.2f} of a core; server "
                  f"{server_cores / rate * 1e6:.0f} us/step; {per_run:.1f} steps/run)")  # fmt: skip
            results.setdefault(protocol, {})[label] = rate
        ratios = [n[0] / f[0] for n, f in zip(cells[protocol, "on"], cells[protocol, "off"])]
        ratio = results[protocol]["ratio"] = statistics.median(ratios)
        print(f"    {name:<5} throughput ratio, batching on / off: {ratio:.2f}x "
              f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
        key = f"seq_gru{vocab}_serve_{protocol}"
        _common.record(f"{SEQUENCES} GRU sequences (vocabulary {vocab}), neuropod serve ({name}), batching on vs off",
                       key, method=f"steps/s, median of {rounds} rounds of {seconds:g} s, {SEQUENCES} client threads",
                       **results[protocol])  # fmt: skip
        _common.verdict(f"served ({name}, vocabulary {vocab}), batching on >= {BATCHING_TARGET:g}x off",
                        ratio >= BATCHING_TARGET, f"{ratio:.2f}x", key=key)  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round of the tiny model (default 2000)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of the tiny model (default 21)")
    parser.add_argument("--rounds-gru", type=int, default=15, help="rounds of the GRU in process (default 15)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of each served cell (default 3)")
    parser.add_argument("--rounds-serve", type=int, default=3, help="rounds of the served cells (default 3)")
    parser.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS), metavar="N",
                        help=f"the GRU's vocabularies (default {' '.join(map(str, VOCABS))})")  # fmt: skip
    parser.add_argument("--protocols", nargs="+", choices=list(PROTOCOLS), default=list(PROTOCOLS),
                        help="the clients' protocols (default: grpc http)")  # fmt: skip
    parser.add_argument("--no-serve", action="store_true", help="in process only")
    parser.add_argument("--serve-on", default=DEFAULT_ON, help=f"neuropod serve's options with sequence batching on "
                        f"(default {DEFAULT_ON!r})")  # fmt: skip
    parser.add_argument("--serve-off", default="", help="its options with sequence batching off (default: none)")
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds, 2 s per server")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    _common.add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds, args.rounds_gru, args.seconds, args.rounds_serve = 500, 7, 5, 2.0, 1
    import torch

    torch.set_num_threads(1)
    pinned = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, {CLIENT_CORE})
    print(f"neuropod {neuropod.__version__}, torch {torch.__version__}; this process on "
          f"{'core 1, servers on core 0' if pinned else 'every core (no taskset or one core)'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-sequences-") as d:
        tmp = Path(d)
        step_cost(tmp, args.calls, args.rounds)
        for vocab in args.vocab:
            package = gru_package(tmp, vocab)
            in_process(package, vocab, args.rounds_gru)
            if not args.no_serve:
                served(tmp, package, vocab, args.seconds, args.rounds_serve, args.serve_on.split(), args.serve_off.split(),
                       args.protocols)  # fmt: skip
    versions = {"neuropod": neuropod.__version__, "torch": torch.__version__}
    _common.write_json(args.json, "bench_sequences", versions)
    missed = [t for t in _common.TARGETS if not t["met"]]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
