"""neuropod.probe: facts learnt in a fresh interpreter, and every way a probe can fail as a PackageError."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuropod.errors import PackageError
from neuropod.probe import ProbeFailure, run_probe

PROBES = '''
import os, signal, sys, time
from neuropod.probe import ProbeFailure

def answer(*args):
    return {"args": list(args), "pid": os.getpid()}

def explained(path):
    raise ProbeFailure(f"OSError: cannot open {path}: no such file")

def crashes():
    raise RuntimeError("unexpected")

def aborts():
    sys.stderr.write("terminate called after throwing an instance of 'c10::Error'\\n  what():  op registered twice\\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGABRT)

def silent():
    os._exit(0)

def slow():
    time.sleep(30)
'''


@pytest.fixture
def probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of probe functions, importable in this process and in the probe's."""
    (tmp_path / "neuropod_test_probes.py").write_text(PROBES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import neuropod_test_probes  # noqa: F401  # the probe's environment finds it where this process did

    yield "neuropod_test_probes"
    sys.modules.pop("neuropod_test_probes", None)


def test_answer_comes_back_from_another_process(probes: str) -> None:
    import os

    found = run_probe(f"{probes}:answer", ["a", "b c"], "learning")
    assert found["args"] == ["a", "b c"] and found["pid"] != os.getpid()


@pytest.mark.parametrize(
    ("function", "args", "message"),
    [
        ("explained", ["/x.so"], r"^lib x: the probe exited with code 1:\nOSError: cannot open /x.so: no such file$"),
        ("crashes", [], r"the probe exited with code 1:\n(.|\n)*RuntimeError: unexpected"),
        ("aborts", [], r"killed by SIGABRT; loading it into this process would have ended it the same way:\n"
                       r"\s*what\(\):  op registered twice"),
        ("silent", [], r"the probe printed no answer"),
    ],
)  # fmt: skip
def test_failures_are_package_errors(probes: str, function: str, args: list[str], message: str) -> None:
    with pytest.raises(PackageError, match=message):
        run_probe(f"{probes}:{function}", args, "lib x")


def test_timeout(probes: str) -> None:
    with pytest.raises(PackageError, match=r"lib x: the probe did not finish within 0.5 s"):
        run_probe(f"{probes}:slow", [], "lib x", timeout=0.5)


def test_clean_output_and_env(probes: str, tmp_path: Path) -> None:
    (tmp_path / "neuropod_test_probes.py").write_text(
        PROBES + "\ndef noisy():\n    print('I0000 framework log', file=sys.stderr)\n"
        "    print('the reason: ' + os.environ['PROBE_VAR'], file=sys.stderr)\n    sys.exit(3)\n"
    )  # fmt: skip
    drop_logs = lambda text: "\n".join(ln for ln in text.splitlines() if not ln.startswith("I0000"))  # noqa: E731
    with pytest.raises(PackageError) as caught:
        run_probe(f"{probes}:noisy", [], "lib x", env={"PROBE_VAR": "set"}, clean_output=drop_logs)
    assert str(caught.value) == "lib x: the probe exited with code 3:\nthe reason: set"


def test_probe_failure_is_an_exception_type() -> None:
    assert issubclass(ProbeFailure, Exception)


def test_cached_probe_recomputes_and_replaces_a_damaged_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuropod.backend import cached_probe

    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[int] = []

    def compute() -> dict[str, list[str]]:
        calls.append(1)
        return {"ops": ["ns::op"]}

    def valid(found: object) -> bool:
        return isinstance(found, dict) and isinstance(found.get("ops"), list)

    assert cached_probe("kind", "key", compute, valid) == {"ops": ["ns::op"]}
    assert cached_probe("kind", "key", compute, valid) == {"ops": ["ns::op"]} and len(calls) == 1, "read from the cache"
    (entry,) = (tmp_path / "cache" / "probes").glob("kind-key.json")
    entry.write_text('["not", "an", "answer"]')
    assert cached_probe("kind", "key", compute, valid) == {"ops": ["ns::op"]} and len(calls) == 2
    assert cached_probe("kind", "key", compute, valid) == {"ops": ["ns::op"]} and len(calls) == 2, "the entry was replaced"
