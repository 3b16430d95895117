"""What the ray_config tests share: stopping a command that runs a Ray cluster of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import IO


def stop_with_ctrl_c(
    proc: subprocess.Popen[bytes], log: IO[bytes], seconds: float = 150, again_every: float | None = None
) -> None:
    """Ctrl-C, as a user stops it (the command deletes its applications and stops the cluster it
    started); SIGKILL to its whole session when that takes longer than ``seconds``. Ray Serve
    gives each replica up to 20 s to stop gracefully before it kills it, one application after
    another, so on a loaded machine a clean stop can take a minute; the time it took is
    written to the log either way, with how many times Ctrl-C was pressed (again every
    ``again_every`` seconds when given)."""
    started = time.monotonic()
    presses = 0
    try:
        # With again_every, pressed again while it runs, as a user would. Ray's own `serve run`,
        # pressed again every 30 s, took over two minutes to stop (pressed once, about 5 s): its
        # test presses once.
        while proc.poll() is None and time.monotonic() - started < seconds:
            if presses == 0 or again_every is not None:
                os.killpg(proc.pid, signal.SIGINT)
                presses += 1
            left = max(0.1, seconds - (time.monotonic() - started))
            try:
                proc.wait(min(again_every, left) if again_every is not None else left)
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        log.write(f"\n[test] Ctrl-C ({presses}x) to exit: {time.monotonic() - started:.1f} s\n".encode())
        log.close()
