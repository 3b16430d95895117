"""One candidate, run alone in a fresh process: ``python -m neuropod.comparison.worker JOB.json``.

It loads the candidate, runs every input set (outputs to the job's ``.npz``), measures speed
and memory, and writes what it found to the job's result file, an error and the stage it
happened at included: the parent reads that file, never this process's traceback. Progress
goes to stdout, one JSON line per step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuropod.comparison import measure
from neuropod.comparison.inputs import batch_of, load_sets, save_sets
from neuropod.errors import NeuropodError
from neuropod.loader import load_neuropod
from neuropod.testdata import joined_responses


def _progress(text: str) -> None:
    print(json.dumps({"progress": text}), flush=True)


def _caller(model: Any) -> Any:
    """How a candidate is called: as ``neuropod test`` runs it (a decoupled model's responses joined,
    a stateful model one step of a new sequence)."""
    if getattr(model, "decoupled", False):
        return lambda inputs: joined_responses(model, inputs)
    if getattr(model, "stateful", False):

        def step(inputs: dict[str, Any]) -> Any:
            with model.sequence() as sequence:
                return sequence.infer(inputs, end=True)

        return step
    return model.infer


def _renamed(tensors: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    return {renames.get(k, k): v for k, v in tensors.items()}


def run(job: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"memory": {}, "throughput": [], "notes": []}
    gpu = measure.GpuMemory()
    result["memory"]["rss_before_load"] = measure.rss_now()
    stage = "load"
    gpu.start()
    try:
        _progress("loading")
        options = dict(job.get("remote_options") or {})
        if not job.get("remote"):
            options.update(backend=job.get("backend"), device=job.get("device"), use_ope=bool(job.get("use_ope")))
        t0 = time.perf_counter()
        model = load_neuropod(job["target"], **options)
        result["load_s"] = time.perf_counter() - t0
        with model:
            b = model.backend
            result.update(model_name=model.name, backend=b.id, location=b.location, device=str(model.device),
                          framework=f"{b.framework} {b.version}" if getattr(b, "framework", None) else None)  # fmt: skip
            gpu.sample(measure.process_tree())
            stage = "run"
            _progress("running the inputs")
            call = _caller(model)
            to_own, to_base = job.get("rename_inputs") or {}, job.get("rename_outputs") or {}
            sets = load_sets(Path(job["inputs"]))
            outputs = [_renamed(call(_renamed(s, to_own)), to_base) for s in sets]
            save_sets(Path(job["outputs"]), outputs)
            result["outputs_saved"] = True
            if job.get("speed"):
                stage = "measure"
                first = _renamed(sets[0], to_own)
                _progress("latency, one call at a time")
                result["latency"] = measure.single_stream(call, first, warmup=job["warmup"], duration=job["duration"])
                gpu.sample(measure.process_tree())
                symbol = job.get("batch_symbol")
                for size in job.get("batch_sizes") or []:
                    if symbol is None:
                        break
                    _progress(f"throughput at batch size {size}")
                    batch = _renamed(batch_of(sets[0], size), to_own)
                    result["throughput"].append(measure.offline(call, batch, size, duration=job["duration"]))
                    gpu.sample(measure.process_tree())
                if job.get("batch_sizes") and symbol is None:
                    result["notes"].append("no throughput by batch size: the inputs share no batch symbol as their "
                                           "first dimension")  # fmt: skip
                if job.get("rate"):
                    _progress(f"latency at {job['rate']:g} calls/s")
                    result["server"] = measure.server(call, first, job["rate"], duration=job["duration"],
                                                      seed=job.get("seed", 0))  # fmt: skip
                    gpu.sample(measure.process_tree())
            tree = measure.process_tree()
            peak, note = measure.peak_rss(tree)
            if job.get("remote"):
                note = ("the client's process only (the comparison's worker calling the server): a served model's "
                        "memory (RSS and GPU) is the server's, not measured here")  # fmt: skip
            result["memory"].update(peak_rss=peak, note=note)
            gpu.sample(tree)
    except NeuropodError as e:
        result.update(error=str(e), stage=stage)
    except Exception as e:  # noqa: BLE001  # a framework's own error: reported with its class, as a failed candidate
        result.update(error=f"{type(e).__name__}: {e}", stage=stage)
    finally:
        gpu.stop()
    result["memory"]["gpu_bytes"] = None if job.get("remote") else gpu.peak  # the client's would read as the model's
    return result


def main(argv: list[str] | None = None) -> int:
    from dataclasses import asdict, is_dataclass

    args = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    result = run(job)

    def plain(v: Any) -> Any:
        return asdict(v) if is_dataclass(v) and not isinstance(v, type) else str(v)

    Path(job["result"]).write_text(json.dumps(result, default=plain), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
