"""Are the candidates one problem? Their specs read, tensors renamed by ``--map``, and compared.

Two specs are the same problem when, after the renames, they have the same input and output
names, the same dtypes, and shapes that fit each other: the same rank, equal fixed sizes, and
symbols that correspond one to one (``batch_size`` in one may be ``N`` in the other, but a symbol
may not stand for two different symbols or fixed sizes). A symbol against a fixed size, or a
``None`` dimension, fits and is noted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuropod.comparison.candidates import Candidate
from neuropod.errors import NeuropodError
from neuropod.spec import TensorSpec


class ProblemMismatch(NeuropodError):
    """The candidates' specs are not the same problem; the message lists every difference."""

    def __init__(self, differences: Sequence[str]):
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"The candidates are not the same problem ({len(self.differences)} difference"
            f"{'' if len(self.differences) == 1 else 's'}):\n{lines}\n"
            "(a tensor renamed in one candidate: --map CANDIDATE.TENSOR=BASELINE_TENSOR)"
        )


@dataclass
class Facts:
    """What a candidate is, read before anything runs: its spec, and its package if it has one."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    package: Path | None = None
    package_bytes: int | None = None
    has_test_data: bool = False
    model_name: str = ""
    #: Candidate tensor name -> baseline tensor name (``--map``), inputs and outputs.
    renames: dict[str, str] = field(default_factory=dict)

    def to_baseline(self, name: str) -> str:
        return self.renames.get(name, name)


def read_facts(candidate: Candidate, *, remote_options: Mapping[str, Any] | None = None,
               trust_pickle: bool = False) -> Facts:  # fmt: skip
    """A candidate's spec: from its package (downloaded first when given by URL), or from the server."""
    if candidate.remote:
        from neuropod.loader import load_neuropod  # lazy: numpy and the loader, only for a served candidate

        with load_neuropod(candidate.target, **dict(remote_options or {})) as model:
            return Facts(list(model.inputs), list(model.outputs), model_name=model.name)
    from neuropod.package import read_package  # lazy: numpy, kept out of parsing candidates
    from neuropod.storage import fetch, is_package_url  # lazy: numpy (the download cache), as read_package

    path = Path(fetch(candidate.target) if is_package_url(candidate.target) else candidate.target)
    package = read_package(path)
    return Facts(
        list(package.config.input_spec), list(package.config.output_spec), package=path,
        package_bytes=_size(path), has_test_data=package.has_test_data, model_name=package.name,
    )  # fmt: skip


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def parse_maps(maps: Iterable[str], labels: Sequence[str]) -> dict[str, dict[str, str]]:
    """``--map`` values as candidate label -> {its tensor name: the baseline's tensor name}.

    ``LABEL.TENSOR=BASELINE_TENSOR``, or ``LABEL.TENSOR=LABEL.TENSOR`` with one side the
    baseline; a LABEL may be the candidate's position (``2``, the first is ``1``).
    """
    out: dict[str, dict[str, str]] = {}
    for text in maps:
        left, eq, right = text.partition("=")
        if not eq or not left or not right:
            raise NeuropodError(f"--map {text!r} must be CANDIDATE.TENSOR=BASELINE_TENSOR (e.g. 2.logits=out)")
        a_label, a_tensor = _split_ref(left, labels, text)
        b_label, b_tensor = _split_ref(right, labels, text)
        if a_label is None:
            raise NeuropodError(f"--map {text!r}: the left side must name a candidate (LABEL.TENSOR); candidates: "
                                f"{', '.join(labels)}")  # fmt: skip
        if b_label is None or b_label == labels[0]:
            cand, own, base = a_label, a_tensor, b_tensor
        elif a_label == labels[0]:
            cand, own, base = b_label, b_tensor, a_tensor
        else:
            raise NeuropodError(f"--map {text!r}: one side must be the baseline ({labels[0]!r}) or a bare tensor name")
        if cand == labels[0]:
            raise NeuropodError(f"--map {text!r} renames a tensor of the baseline; the baseline's names are the ones "
                                "others are mapped onto")  # fmt: skip
        renames = out.setdefault(cand, {})
        if own in renames and renames[own] != base:
            raise NeuropodError(f"--map maps {cand}.{own} twice ({renames[own]!r}, {base!r})")
        renames[own] = base
    return out


def _split_ref(text: str, labels: Sequence[str], whole: str) -> tuple[str | None, str]:
    index = re.match(r"^(\d+)\.(.+)$", text)
    if index:
        n = int(index.group(1))
        if not 1 <= n <= len(labels):
            raise NeuropodError(f"--map {whole!r}: there is no candidate {n} (there are {len(labels)})")
        return labels[n - 1], index.group(2)
    matches = [label for label in labels if text.startswith(label + ".") and len(text) > len(label) + 1]
    if not matches:
        return None, text
    label = max(matches, key=len)
    return label, text[len(label) + 1 :]


def check_problem(labels: Sequence[str], facts: Sequence[Facts]) -> list[str]:
    """Check every candidate against the first (the baseline) after its renames; return notes.

    :raises ProblemMismatch: listing every difference, or a ``--map`` naming a tensor that is not there.
    """
    base = facts[0]
    differences: list[str] = []
    notes: list[str] = []
    for label, f in zip(labels[1:], facts[1:]):
        own_names = {t.name for t in [*f.inputs, *f.outputs]}
        for own, target in f.renames.items():
            if own not in own_names:
                raise NeuropodError(f"--map {label}.{own}={target}: candidate {label!r} has no tensor {own!r}; its "
                                    f"tensors: {', '.join(sorted(own_names))}")  # fmt: skip
            notes.append(f"{label}: its {own!r} is compared as the baseline's {target!r}")
        symbols: dict[Any, Any] = {}
        for kind, mine, theirs in (("input", f.inputs, base.inputs), ("output", f.outputs, base.outputs)):
            renamed: dict[str, TensorSpec] = {}
            for t in mine:
                name = f.to_baseline(t.name)
                if name in renamed:  # a --map onto a name the candidate already has, or two onto one
                    differences.append(f"{label}'s {kind}s {renamed[name].name!r} and {t.name!r} would both be the "
                                       f"baseline's {name!r} (check --map)")  # fmt: skip
                renamed[name] = t
            wanted = {t.name: t for t in theirs}
            for name in sorted(wanted.keys() - renamed.keys()):  # sorted: the same message every run
                differences.append(f"{label} has no {kind} {name!r} (the baseline's {wanted[name]})")
            for name in sorted(renamed.keys() - wanted.keys()):
                differences.append(f"{label} has an {kind} {name!r} the baseline does not have ({renamed[name]})")
            for name in sorted(renamed.keys() & wanted.keys()):
                differences += _tensor_differences(label, kind, renamed[name], wanted[name], symbols, notes)
    if differences:
        raise ProblemMismatch(differences)
    return notes


def _tensor_differences(label: str, kind: str, mine: TensorSpec, theirs: TensorSpec, symbols: dict[Any, Any],
                        notes: list[str]) -> list[str]:  # fmt: skip
    where = f"{label}'s {kind} {theirs.name!r}"
    if mine.dtype != theirs.dtype:
        return [f"{where} is {mine.dtype}, the baseline's is {theirs.dtype}"]
    if len(mine.shape) != len(theirs.shape):
        return [f"{where} has shape {mine.describe_shape()}, the baseline's {theirs.describe_shape()} (another rank)"]
    out = []
    for axis, (a, b) in enumerate(zip(mine.shape, theirs.shape)):
        if a is None or b is None:
            continue
        if isinstance(a, int) and isinstance(b, int):
            if a != b:
                out.append(f"{where} has size {a} on axis {axis}, the baseline's has {b}")
            continue
        if not (isinstance(a, str) and isinstance(b, str)):  # a symbol against a fixed size fits (noted below)
            notes.append(f"{where}: axis {axis} is {a!r} here and {b!r} in the baseline")
            continue
        for key, other in ((("mine", a), b), (("theirs", b), a)):
            bound = symbols.setdefault(key, other)
            if bound != other:
                side = label if key[0] == "mine" else "the baseline"
                out.append(f"{where}: {side}'s symbol {key[1]!r} stands for {bound!r} elsewhere and for {other!r} "
                           f"on axis {axis} here")  # fmt: skip
        if a != b:
            note = f"{label}: symbol {a!r} is the baseline's {b!r}"
            if note not in notes:
                notes.append(note)
    return out
