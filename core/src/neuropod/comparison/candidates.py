"""The candidates of a comparison: a package (path or URL) with optional pins, or a remote model's URL.

A candidate is written ``[LABEL=]TARGET[@PIN]...``:

- ``TARGET``: a package directory or zip, a package URL (``s3://``, ``gs://``, ``az://``, an
  ``https://`` zip), or a served model (``grpc://host:8001/adder``, an OIP ``http://`` URL);
- ``@PIN``: ``@cpu`` or ``@cuda:N`` (the device), ``@ope`` (run in a worker process), or a
  backend pin as ``load_neuropod(backend=...)`` takes it (``@onnx``, ``@onnx==1.20.1``; a
  version with no backend installed here runs in a backend environment of that version);
- ``LABEL=``: the name the table and the report use (default: the target's file name and its pins).

A path that exists is taken whole, ``@`` and ``=`` included.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from neuropod.errors import NeuropodError
from neuropod.storage.urls import is_package_url

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_BACKEND = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*((==|~=|>=|<=|!=|<|>)[A-Za-z0-9_.*+!-]+)?$")
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,63}$")


@dataclass(frozen=True)
class Candidate:
    """One implementation to compare; build with :func:`parse_candidate` or directly."""

    target: str
    label: str = ""
    backend: str | None = None
    device: str | None = None
    use_ope: bool = False
    #: As given on the command line (for the report).
    given: str = ""

    @property
    def remote(self) -> bool:
        """A served model (``grpc://``, an OIP ``http://`` URL); a package URL (``s3://``, ``https://...zip``) is not."""
        from neuropod.remote import is_remote  # lazy: keeps this module free of the remote registry

        return is_remote(self.target) and not is_package_url(self.target)


def parse_candidate(text: str, *, use_ope: bool = False) -> Candidate:
    """Read ``[LABEL=]TARGET[@PIN]...`` (see the module's doc).

    :raises NeuropodError: an empty target, a pin given twice, a bad label, or pins on a remote model.
    """
    if not isinstance(text, str) or not text.strip():
        raise NeuropodError(f"A candidate must be a package path or URL, got {text!r}")
    if os.path.exists(text):
        return _checked(Candidate(target=text, label=_default_label(text, None, None, use_ope), use_ope=use_ope,
                                  given=text))  # fmt: skip
    label = ""
    head, eq, rest = text.partition("=")
    if eq and _LABEL.match(head) and "://" not in head:
        label, text_left = head, rest
    else:
        text_left = text
    target, pins = _split_pins(text_left)
    backend = device = None
    ope = use_ope
    for pin in pins:
        if pin == "ope":
            ope = True
        elif _DEVICE.match(pin):
            if device is not None:
                raise NeuropodError(f"Candidate {text!r} pins two devices ({device}, {pin}); give one")
            device = pin
        else:
            if backend is not None:
                raise NeuropodError(f"Candidate {text!r} pins two backends ({backend}, {pin}); give one")
            backend = pin
    if not target:
        raise NeuropodError(f"Candidate {text!r} names no package or URL before its pins")
    if ope and "ope" not in pins and Candidate(target=target).remote:
        ope = False  # --use-ope is for the packages among the candidates; a served model runs where it is served
    candidate = Candidate(target=target, label=label or _default_label(target, backend, device, ope),
                          backend=backend, device=device, use_ope=ope, given=text)  # fmt: skip
    return _checked(candidate)


def _split_pins(text: str) -> tuple[str, list[str]]:
    """``TARGET@PIN@PIN`` -> (TARGET, [PIN, PIN]): pins are taken from the right while they read as pins."""
    pins: list[str] = []
    target = text
    while "@" in target:
        head, _, tail = target.rpartition("@")
        if not (tail == "ope" or _DEVICE.match(tail) or _BACKEND.match(tail)) or "/" in tail:
            break
        if os.path.exists(target):  # a path with '@' in its name
            break
        pins.insert(0, tail)
        target = head
    return target, pins


def _checked(candidate: Candidate) -> Candidate:
    if candidate.remote and (candidate.backend or candidate.device or candidate.use_ope):
        pins = ", ".join(p for p in (candidate.backend, candidate.device, "ope" if candidate.use_ope else None) if p)
        raise NeuropodError(
            f"Candidate {candidate.given or candidate.target!r} is a served model, which runs where it is served: "
            f"pins ({pins}) and --use-ope apply to packages only"
        )
    return candidate


def _default_label(target: str, backend: str | None, device: str | None, ope: bool) -> str:
    name = target.rstrip("/")
    if "://" not in target:
        name = Path(name).name
        for suffix in (".neuropod", ".zip"):
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
    return name + "".join(f"@{p}" for p in (backend, device, "ope" if ope else None) if p)


def unique_labels(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates with labels made unique (``adder``, ``adder#2``); a label given twice is an error."""
    from dataclasses import replace

    # a LABEL= written by the user is kept as written (a package named like its label, ``adder``, given
    # twice is numbered): the user's --map names it
    explicit = [bool(c.given) and "=" in c.given and c.given.partition("=")[0] == c.label for c in candidates]
    used: set[str] = set()
    for c, mine in zip(candidates, explicit):
        if mine:
            if c.label in used:
                raise NeuropodError(f"Two candidates are labelled {c.label!r}; give each its own LABEL=")
            used.add(c.label)
    out: list[Candidate] = []
    for c, mine in zip(candidates, explicit):
        if mine:
            out.append(c)
            continue
        label, n = c.label, 1
        while label in used:
            n += 1
            label = f"{c.label}#{n}"
        used.add(label)
        out.append(replace(c, label=label))
    return out
