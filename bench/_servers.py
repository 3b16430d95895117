"""A benchmark's server processes: each started in a process group of its own with its output in a
log file, waited for until it answers ready, and stopped with everything it started (its group).

Light on purpose (the standard library only), so that any bench can use it without the others'
dependencies.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

#: A clean shutdown first (SIGINT, as Ctrl-C), then SIGKILL: each with the seconds it is given.
INTERRUPT_THEN_KILL = ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A free port whose successor is free too (a server's REST port and its gRPC port)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a server's log, for an error message."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    proc: subprocess.Popen[bytes], label: str, log: Path, urls: Sequence[str], timeout: float, *,
    ready: Callable[[], bool] | None = None, error: Callable[[str], BaseException] = RuntimeError,
) -> None:  # fmt: skip
    """Wait until each of ``urls`` answers 200, in turn (with no URLs: until ``ready()`` is true).

    :raises: ``error`` (RuntimeError by default) with the end of the log, when the process exits
        or ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending or ready is not None:
        if proc.poll() is not None:
            raise error(f"{label} exited with status {proc.returncode} while starting:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise error(f"{label} was not ready after {timeout:.0f} s:\n{log_tail(log)}")
        if not pending:
            assert ready is not None
            if ready():
                return
        else:
            try:
                with urllib.request.urlopen(pending[0], timeout=2) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(0.2)


def stop_group(proc: subprocess.Popen[bytes], signals: Sequence[tuple[int, float]] = INTERRUPT_THEN_KILL) -> None:
    """Send each signal to the process group of ``proc`` (its leader) in turn, waiting the seconds
    given for the leader to exit; once it has, SIGKILL whatever it left in its group."""
    for sig, wait in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        break
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
