"""What the ray_config tests share: stopping a command that runs a Ray cluster of its own."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import IO


def stop_with_ctrl_c(proc: subprocess.Popen[bytes], log: IO[bytes], seconds: float = 60) -> None:
    """Ctrl-C, as a user stops it (the command deletes its applications and stops the cluster it
    started); SIGKILL to its whole session when that takes longer than ``seconds``."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        log.close()
