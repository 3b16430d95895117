"""What the ray_config tests share: stopping a command that runs a Ray cluster of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import IO


def stop_with_ctrl_c(proc: subprocess.Popen[bytes], log: IO[bytes], seconds: float = 150) -> None:
    """Ctrl-C, as a user stops it (the command deletes its applications and stops the cluster it
    started); SIGKILL to its whole session when that takes longer than ``seconds``. Ray Serve
    gives each replica up to 20 s to stop gracefully before it kills it, one application after
    another, so on a loaded machine a clean stop can take a minute; the time it took is
    written to the log either way."""
    os.killpg(proc.pid, signal.SIGINT)
    started = time.monotonic()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        log.write(f"\n[test] Ctrl-C to exit: {time.monotonic() - started:.1f} s\n".encode())
        log.close()
