"""Runs every code block of the documentation and the READMEs (``nox -s docs``).

Sybil collects the Markdown files pytest is given: ``docs/`` and the README files. Each document runs in a
fresh temporary directory, top to bottom, in one namespace:

- ```` ```python ```` blocks are executed;
- ```` ```console ```` blocks run each ``$ command`` with bash; the lines
  after a command are its expected output, matched line by line in order
  (``...`` matches any text, and unmatched output lines in between are
  allowed); a command exits 0 unless it ends with ``# exits N``; a command
  ending with ``&`` starts in the background (a server), is waited for until
  every port it names (``--http-port``, ``--grpc-port``, ``--metrics-port``;
  ``neuropod serve``'s defaults otherwise) accepts connections, and is
  stopped when the document ends;
- ```` ```bash ```` blocks run as one ``bash -euo pipefail`` script; a page's
  shell blocks share their working directory and exported variables, as in a
  terminal (``cd``, ``source venv/bin/activate``), and ``$NEUROPOD_SRC`` is
  the checkout;
- a block right after a line ``Create `path`:`` is written to that file (in
  the shell's working directory) instead of being run;
- ``<!-- skip: next "reason" -->`` skips the next block, with the reason
  printed (a GPU, a Ray cluster, a second machine, an install command);
  ``<!-- invisible-code-block: python -->`` runs setup code readers do not see.

Other nox sessions do not install Sybil, and this file then collects nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent

try:
    from sybil import Example, Region, Sybil
    from sybil.parsers.myst import CodeBlockParser, PythonCodeBlockParser, SkipParser
except ImportError:  # every session but docs
    Sybil = None  # type: ignore[assignment,misc]


# --- one temporary directory per document ------------------------------------


def _setup(namespace: dict[str, Any]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="neuropod-docs-"))
    namespace["__docs_tmp__"] = tmp
    namespace["__docs_cwd__"] = os.getcwd()
    namespace["__docs_background__"] = []
    namespace["__docs_root__"] = ROOT
    os.chdir(tmp)


def _teardown(namespace: dict[str, Any]) -> None:
    for proc in namespace.get("__docs_background__", []):
        _stop(proc)
    for value in list(namespace.values()):  # models and clients the page left open
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith(("neuropod", "tritonclient")):
            try:
                close()
            except Exception:  # noqa: BLE001 - a page's leftovers must not fail its teardown
                pass
    os.chdir(namespace["__docs_cwd__"])
    shutil.rmtree(namespace["__docs_tmp__"], ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- console blocks ------------------------------------------------------------


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """``[(command, expected output lines)]``; a trailing backslash continues a command."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith("$ "):
            if out:
                out[-1][1].append(line)
            elif line.strip():
                raise ValueError(f"console block: text before the first '$ ' command: {line!r}")
            continue
        command = line[2:]
        while command.endswith("\\") and i < len(lines):
            command = command[:-1] + " " + lines[i].strip()
            i += 1
        out.append((command, []))
    return out


def _line_pattern(expected: str) -> re.Pattern[str]:
    parts = [re.escape(" ".join(p.split())) for p in expected.strip().split("...")]
    return re.compile(".*".join(parts))


def _check_output(command: str, expected: list[str], output: str) -> None:
    wanted = [line for line in expected if line.strip() and line.strip() != "..."]
    actual = [" ".join(line.split()) for line in output.splitlines()]
    at = 0
    for line in wanted:
        pattern = _line_pattern(line)
        while at < len(actual) and not pattern.fullmatch(actual[at]):
            at += 1
        if at == len(actual):
            raise AssertionError(f"$ {command}\nexpected a line matching:\n  {line.strip()}\nin the output:\n{output}")
        at += 1


def _wait_for_ports(command: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until every port the command names (``--http-port``, ``--grpc-port``, ``--metrics-port``, ``--port``;
    ``neuropod serve``'s defaults where it names none) accepts connections."""
    named = dict(re.findall(r"--(http-port|grpc-port|metrics-port|port)[= ](\d+)", command))
    if "neuropod serve" in command:
        named = {"http-port": "8000", "grpc-port": "8001", "metrics-port": "8002", **named}
    ports = sorted({int(p) for p in named.values() if int(p)} or {8000})
    deadline = time.monotonic() + 120
    waiting = list(ports)
    while waiting:
        if proc.poll() is not None:
            raise AssertionError(f"$ {command}\nexited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", waiting[0])) == 0:
                waiting.pop(0)
                continue
        if time.monotonic() > deadline:
            raise AssertionError(f"$ {command}\nnot listening on {waiting} after 120 s:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)


def _shell_state(namespace: dict[str, Any]) -> tuple[Path, Path]:
    """The files one page's shell blocks share: its working directory and exported variables, so
    that ``cd DIR`` and ``source venv/bin/activate`` in one block hold in the next, as in a terminal."""
    return namespace["__docs_tmp__"] / ".shell-cwd", namespace["__docs_tmp__"] / ".shell-env"


def _shell_cwd(namespace: dict[str, Any]) -> Path:
    cwd_file, _ = _shell_state(namespace)
    return Path(cwd_file.read_text().strip()) if cwd_file.is_file() else namespace["__docs_tmp__"]


def _bash(namespace: dict[str, Any], script: str, *, strict: bool, keep_state: bool = True) -> list[str]:
    cwd_file, env_file = _shell_state(namespace)
    q = shlex.quote
    prelude = f"[ -f {q(str(env_file))} ] && source {q(str(env_file))} 2>/dev/null; cd {q(str(_shell_cwd(namespace)))}\n"
    if keep_state:
        prelude += f"trap 'pwd > {q(str(cwd_file))}; export -p > {q(str(env_file))}' EXIT\n"
    return ["bash", "-c", prelude + ("set -euo pipefail\n" if strict else "") + script]


def run_console(example: Example) -> None:
    namespace = example.namespace
    for command, expected in _commands(example.parsed):
        exits = re.search(r"#\s*exits (\d+)\s*$", command)
        want_rc = int(exits.group(1)) if exits else 0
        if command.rstrip().endswith("&"):
            log = Path(tempfile.mkstemp(prefix="background-", suffix=".log", dir=namespace["__docs_tmp__"])[1])
            proc = subprocess.Popen(
                _bash(namespace, command.rstrip()[:-1], strict=False, keep_state=False),
                stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            namespace["__docs_background__"].append(proc)
            _wait_for_ports(command, proc, log)
            continue
        done = subprocess.run(
            _bash(namespace, command, strict=False), capture_output=True, text=True, timeout=900, check=False
        )
        output = done.stdout + done.stderr
        if done.returncode != want_rc:
            raise AssertionError(f"$ {command}\nexited with {done.returncode}, not {want_rc}:\n{output}")
        _check_output(command, expected, output)


def run_bash(example: Example) -> None:
    done = subprocess.run(
        _bash(example.namespace, example.parsed, strict=True), capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    if done.returncode:
        raise AssertionError(f"{example.parsed}\nexited with {done.returncode}:\n{done.stdout}{done.stderr}")


# --- "Create `path`:" blocks: files a tutorial has the reader write -------------

# The same pattern core/tests/test_docs.py reads the backend tutorial's files with.
CREATE = re.compile(r"^Create `([^`]+)`:\n\n(````|```)[\w-]*\n(.*?)\2\n", re.M | re.S)


def write_file(example: Example) -> None:
    relative, body = example.parsed
    path = _shell_cwd(example.namespace) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")


def _create_blocks(document: Any) -> Any:
    for match in CREATE.finditer(document.text):
        yield Region(match.start(), match.end(), (match.group(1), match.group(3)), write_file)


def _outside_created_files(parser: Any) -> Any:
    """A parser that leaves alone what lies inside a "Create `path`:" block (a README's own examples)."""

    def parse(document: Any) -> Any:
        spans = [(m.start(), m.end()) for m in CREATE.finditer(document.text)]
        for region in parser(document):
            if not any(start <= region.start < end for start, end in spans):
                yield region

    return parse


if Sybil is not None:
    os.environ.setdefault("NEUROPOD_SRC", str(ROOT))  # the checkout, as the backend tutorial installs the core from it
    pytest_collect_file = Sybil(
        parsers=[
            _create_blocks,
            *map(_outside_created_files, [
                PythonCodeBlockParser(future_imports=["annotations"]),
                CodeBlockParser(language="console", evaluator=run_console),
                CodeBlockParser(language="bash", evaluator=run_bash),
                SkipParser(),
            ]),
        ],
        patterns=["*.md"],  # nox -s docs passes docs/ and the README files
        setup=_setup,
        teardown=_teardown,
    ).pytest()

