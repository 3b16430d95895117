"""``neuropod.compare``: check the candidates are one problem, run each in a fresh process of its
own on the same inputs, and compare their outputs, speed and memory with the first's.

Why one process per candidate, one after another: a process's peak memory is then the candidate's
own; no two frameworks' thread pools compete for the cores while one is timed; and no candidate
runs with another's caches, allocator pools or compiled kernels warm. The cost is that candidates
are timed minutes apart, so a machine that changes speed in between (another job, thermal limits)
shows up as a difference: compare medians over a quiet machine, or run twice.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuropod._version import __version__
from neuropod.comparison.agreement import compare_sets
from neuropod.comparison.candidates import Candidate, parse_candidate, unique_labels
from neuropod.comparison.inputs import (
    InputSet,
    batch_axis,
    check_sets,
    generate,
    load_sets,
    parse_dims,
    read_npz,
    save_sets,
)
from neuropod.comparison.problem import Facts, check_problem, parse_maps, read_facts
from neuropod.comparison.results import (
    AGREES,
    BASELINE,
    DISAGREES,
    FAILED,
    NOT_COMPARED,
    CandidateResult,
    Comparison,
    Latency,
    Memory,
    Throughput,
)
from neuropod.errors import NeuropodError

METHOD = (
    "Each candidate ran alone in a fresh process, one after another: its memory figures are its own, no other "
    "framework's threads competed for the cores while it was timed, and none ran with another's caches warm."
)

Progress = Callable[[str], None]


def compare(
    candidates: Sequence[str | Candidate],
    *,
    inputs: Sequence[str | os.PathLike[str] | Mapping[str, Any]] | None = None,
    generate_sets: int | None = None,
    dims: Mapping[str, int] | Sequence[str] | None = None,
    seed: int = 0,
    maps: Sequence[str] = (),
    rtol: float = 1e-4,
    atol: float = 1e-5,
    speed: bool = True,
    warmup: int = 10,
    duration: float = 2.0,
    batch_sizes: Sequence[int] = (1, 8, 32),
    rate: float | None = None,
    max_slowdown: float | None = None,
    use_ope: bool = False,
    timeout: float | None = 600.0,
    remote_options: Mapping[str, Any] | None = None,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    command: str | None = None,
) -> Comparison:
    """Compare implementations of one problem; the first candidate is the baseline.

    :param candidates: ``"[LABEL=]TARGET[@PIN]..."`` strings (see :mod:`neuropod.comparison.candidates`) or
        :class:`Candidate` objects: packages (paths or URLs) and served models' URLs.
    :param inputs: ``.npz`` files or dicts of arrays, one input set each; by default the baseline's bundled
        test data (the first candidate's that has some), else ``generate_sets`` sets generated from its spec.
    :param generate_sets: generate this many input sets from the baseline's spec (``seed``; symbols sized by
        ``dims``, others 2).
    :param maps: ``"CANDIDATE.TENSOR=BASELINE_TENSOR"`` renames.
    :param rtol, atol: the float tolerance (numpy's ``isclose``); strings, bytes, integers and booleans must be equal.
    :param speed: measure latency (``warmup`` calls, then calls one at a time for ``duration`` seconds and at
        least 20), throughput at ``batch_sizes`` when the inputs share a batch symbol, and latency at
        ``rate`` calls per second when given.
    :param max_slowdown: a candidate whose p50 latency is more than this times the baseline's fails the comparison.
    :param timeout: seconds each candidate may take in all (loading, running, measuring); None: no limit.
    :param remote_options: keywords for served candidates (``auth_token``, ``timeout``, ``tls``...).
    :param progress: called with a line per step (the CLI prints them on stderr).
    :raises NeuropodError: bad arguments, unreadable inputs, or candidates that are not one problem
        (:class:`~neuropod.comparison.problem.ProblemMismatch`). A candidate that fails to load or run
        is a failed candidate in the result, not an error.
    """
    say = progress or (lambda _line: None)
    _check_numbers(rtol=rtol, atol=atol, warmup=warmup, duration=duration, rate=rate, max_slowdown=max_slowdown,
                   timeout=timeout, batch_sizes=batch_sizes)  # fmt: skip
    if isinstance(candidates, (str, os.PathLike, Candidate)):
        raise NeuropodError("candidates must be a list of candidates (a package path or URL each), not one "
                            f"{type(candidates).__name__}: compare([{str(candidates)!r}, ...])")  # fmt: skip
    if isinstance(inputs, (str, os.PathLike, Mapping)):
        raise NeuropodError("inputs must be a list of input sets (.npz files or dicts of arrays), not one "
                            f"{type(inputs).__name__}: inputs=[...]")  # fmt: skip
    parsed = unique_labels([c if isinstance(c, Candidate) else parse_candidate(c, use_ope=use_ope) for c in candidates])
    if not parsed:
        raise NeuropodError("Give at least one candidate (a package path or URL, or a served model's URL)")
    labels = [c.label for c in parsed]
    renames = parse_maps(maps, labels)
    results = [_blank(c) for c in parsed]
    facts: list[Facts | None] = []
    for c, r in zip(parsed, results):
        try:
            read = read_facts(c, remote_options=remote_options, trust_pickle=trust_pickle)
        except NeuropodError as e:
            _failed(r, _load_error(c, e, remote_options), "load")
            facts.append(None)
            continue
        read.renames = dict(renames.get(c.label, {}))
        r.package_bytes, r.model_name = read.package_bytes, read.model_name
        facts.append(read)
    known = [(c.label, f) for c, f in zip(parsed, facts) if f is not None]
    notes: list[str] = []
    reference: Facts | None = None
    if known:
        notes = check_problem([label for label, _ in known], [f for _, f in known])
        reference = known[0][1]
    sets: list[InputSet] = []
    source = "none: no candidate could be read"
    if reference is not None:
        dim_sizes = parse_dims([f"{k}={v}" for k, v in dims.items()] if isinstance(dims, Mapping) else dims or (),
                               reference.inputs)  # fmt: skip
        sets, source = _input_sets(parsed, facts, reference, inputs, generate_sets, dim_sizes, seed, trust_pickle)
        check_sets(sets, reference.inputs, source)
    settings = {
        "rtol": rtol, "atol": atol, "speed": speed, "warmup": warmup, "duration": duration,
        "batch_sizes": list(batch_sizes), "rate": rate, "max_slowdown": max_slowdown, "seed": seed,
        "use_ope": use_ope, "timeout": timeout, "maps": list(maps),
    }  # fmt: skip
    symbol = batch_axis(reference.inputs) if reference is not None else None
    outputs: list[list[InputSet] | None] = [None] * len(parsed)
    with tempfile.TemporaryDirectory(prefix="neuropod-compare-") as tmp:
        work = Path(tmp)
        if sets:
            save_sets(work / "inputs.npz", sets)
        for i, (c, cf, r) in enumerate(zip(parsed, facts, results)):
            if cf is None:
                say(f"[{i + 1}/{len(parsed)}] {c.label}: failed before it ran: {r.error}")
                continue
            job = {
                "target": str(cf.package) if cf.package is not None else c.target, "remote": c.remote,
                "backend": c.backend, "device": c.device, "use_ope": c.use_ope,
                "remote_options": dict(remote_options or {}) if c.remote else {},
                "inputs": str(work / "inputs.npz"), "outputs": str(work / f"outputs-{i}.npz"),
                "result": str(work / f"result-{i}.json"),
                "rename_inputs": {base: own for own, base in cf.renames.items()}, "rename_outputs": cf.renames,
                "speed": speed, "warmup": warmup, "duration": duration, "batch_sizes": list(batch_sizes),
                "batch_symbol": symbol, "rate": rate, "seed": seed,
            }  # fmt: skip
            outputs[i] = _run_worker(job, work, r, timeout, _prefixed(say, f"[{i + 1}/{len(parsed)}] {c.label}: "))
    _verdicts(results, outputs, reference, rtol=rtol, atol=atol)
    return Comparison(
        candidates=results, settings=settings, inputs=_describe_sets(sets, source), problem_notes=notes,
        machine=machine(), command=command or "neuropod.compare(...)",
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), neuropod_version=__version__,
        method=METHOD,
    )  # fmt: skip


def _prefixed(say: Progress, prefix: str) -> Progress:
    return lambda line: say(prefix + line)


def _check_numbers(**values: Any) -> None:
    for name in ("rtol", "atol", "duration"):
        v = values[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v != v or v == float("inf"):
            raise NeuropodError(f"{name} must be a finite number of at least 0, got {v!r}")
    if not isinstance(values["warmup"], int) or values["warmup"] < 0:
        raise NeuropodError(f"warmup must be a whole number of calls, at least 0, got {values['warmup']!r}")
    for name in ("rate", "max_slowdown", "timeout"):
        v = values[name]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0
                              or v == float("inf")):  # fmt: skip
            raise NeuropodError(f"{name} must be a finite number above 0, got {v!r}")
    for b in values["batch_sizes"]:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise NeuropodError(f"batch sizes must be whole numbers of at least 1, got {b!r}")


def _blank(c: Candidate) -> CandidateResult:
    return CandidateResult(label=c.label, given=c.given or c.target, target=c.target, backend_pin=c.backend,
                           device_pin=c.device, use_ope=c.use_ope, remote=c.remote)  # fmt: skip


def _failed(r: CandidateResult, error: str, stage: str) -> None:
    r.status, r.error, r.stage, r.verdict = FAILED, error, stage, FAILED


def _load_error(c: Candidate, e: NeuropodError, remote_options: Mapping[str, Any] | None) -> str:
    """A served candidate refused for want of a token says how to give one."""
    refused = getattr(e, "code", None) in ("unauthenticated", "permission_denied")
    if c.remote and refused and not (remote_options or {}).get("auth_token"):
        return f"{e}; give the server's token with --auth-token-file FILE (in Python: remote_options={{'auth_token': ...}})"
    return str(e)


def _input_sets(
    parsed: Sequence[Candidate], facts: Sequence[Facts | None], reference: Facts,
    inputs: Sequence[str | os.PathLike[str] | Mapping[str, Any]] | None, generate_sets: int | None,
    dims: Mapping[str, int], seed: int, trust_pickle: bool,
) -> tuple[list[InputSet], str]:  # fmt: skip
    if inputs:
        sets = [dict(x) if isinstance(x, Mapping) else read_npz(x) for x in inputs]
        names = [os.fspath(x) for x in inputs if not isinstance(x, Mapping)]
        return sets, f"--inputs {', '.join(names)}" if names else "the inputs given"
    if generate_sets:
        return generate(reference.inputs, generate_sets, dims, seed), _generated(dims, seed)
    if dims:
        return generate(reference.inputs, 1, dims, seed), _generated(dims, seed)
    for c, f in zip(parsed, facts):
        if f is not None and f.package is not None and f.has_test_data:
            from neuropod.package import read_package  # lazy: only when test data is read

            test_inputs, _ = read_package(f.package).test_data(trust_pickle=trust_pickle)
            return [{f.to_baseline(k): v for k, v in test_inputs.items()}], f"the test data bundled in {c.label}"
    return generate(reference.inputs, 1, dims, seed), _generated(dims, seed) + " (no candidate bundles test data)"


def _generated(dims: Mapping[str, int], seed: int) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))
    return f"generated from the baseline's spec (seed {seed}" + (
        f"; {sizes})" if sizes else ")")


def _describe_sets(sets: Sequence[InputSet], source: str) -> dict[str, Any]:
    return {
        "source": source, "sets": len(sets),
        "tensors": [{name: {"dtype": str(np.asarray(a).dtype), "shape": list(np.shape(a))} for name, a in s.items()}
                    for s in sets],
    }  # fmt: skip


def _run_worker(job: dict[str, Any], work: Path, r: CandidateResult, timeout: float | None,
                say: Progress) -> list[InputSet] | None:  # fmt: skip
    """Run one candidate's worker; fill ``r`` from its result file; its outputs, or None."""
    job_path = work / f"job-{Path(job['result']).stem}.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    stderr_path = work / f"stderr-{Path(job['result']).stem}.txt"
    started = time.monotonic()
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neuropod.comparison.worker", str(job_path)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=err, start_new_session=True,
        )  # fmt: skip
        reader = threading.Thread(target=_read_progress, args=(proc, say), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            _failed(r, f"did not finish within the timeout of {timeout:g} s (it was killed)", "timeout")
            return None
        except BaseException:
            _kill(proc)
            raise
        finally:
            reader.join(timeout=5)
    elapsed = time.monotonic() - started
    result_path = Path(job["result"])
    if not result_path.is_file():
        tail = _tail(stderr_path)
        _failed(r, f"its process ended with status {proc.returncode} and no result" + (f": {tail}" if tail else ""),
                "crash")  # fmt: skip
        return None
    data = json.loads(result_path.read_text(encoding="utf-8"))
    _fill(r, data)
    first_line = (r.error or "").strip().splitlines()[:1]
    say(f"{'failed: ' + ''.join(first_line) if r.status == FAILED else 'done'} ({elapsed:.1f} s)")
    if not data.get("outputs_saved"):
        return None
    return load_sets(Path(job["outputs"]))


def _read_progress(proc: subprocess.Popen[bytes], say: Progress) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # the model's own output
        if isinstance(line, dict) and isinstance(line.get("progress"), str):
            say(line["progress"])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """The worker and every process it started (its OPE workers): they share its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (OSError, AttributeError):
        proc.kill()
    proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def _fill(r: CandidateResult, data: dict[str, Any]) -> None:
    for key in ("model_name", "backend", "framework", "location", "device", "load_s"):
        if data.get(key) is not None:
            setattr(r, key, data[key])
    if data.get("latency"):
        r.latency = Latency(**data["latency"])
    if data.get("server"):
        r.server = Latency(**data["server"])
    r.throughput = [Throughput(**t) for t in data.get("throughput") or []]
    memory = data.get("memory") or {}
    r.memory = Memory(**{k: memory.get(k) for k in ("rss_before_load", "peak_rss", "gpu_bytes", "note")})
    r.notes.extend(data.get("notes") or [])
    if data.get("error"):
        _failed(r, data["error"], data.get("stage") or "run")


def _verdicts(results: list[CandidateResult], outputs: list[list[InputSet] | None], reference: Facts | None, *,
              rtol: float, atol: float) -> None:  # fmt: skip
    base, base_out = results[0], outputs[0]
    if base.status != FAILED:
        base.verdict = BASELINE
    for r, out in zip(results[1:], outputs[1:]):
        if r.status == FAILED and out is None:
            continue
        if base_out is None or reference is None or out is None:
            r.notes.append("not compared: the baseline has no outputs")
            if r.status != FAILED:
                r.verdict = NOT_COMPARED
            continue
        r.outputs = compare_sets(reference.outputs, base_out, out, rtol=rtol, atol=atol)
        if r.status != FAILED:
            r.verdict = AGREES if all(o.agrees for o in r.outputs) else DISAGREES
        if r.latency is not None and base.latency is not None and base.latency.p50 > 0:
            r.slowdown = r.latency.p50 / base.latency.p50


def machine() -> dict[str, Any]:
    """This machine, for the report: CPU, cores, OS, Python, GPUs (through NVML)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
        "hostname": platform.node(),
    }  # fmt: skip
    try:
        from neuropod.devices import read_nvml  # lazy: the plugin registry, only when a report is made

        host = read_nvml()
        info["gpus"] = [{"name": g.name, "memory": g.memory_total} for g in host.gpus]
        info["gpu_driver"] = host.driver_version
    except Exception:  # noqa: BLE001  # no NVML: no GPUs listed
        info["gpus"] = []
    return info


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["neuropod", *argv])

