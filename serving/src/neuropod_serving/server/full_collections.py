"""Seconds this process spends in full garbage collections: what a model's run time leaves out.

The engine learns from each run's time whether a model is fast enough to run on the event
loop (:mod:`~neuropod_serving.server.engine`); a full collection that fell into a run stops
every thread, and is not the model being slow.
"""

from __future__ import annotations

import atexit
import gc
import time
from typing import Any


class FullCollections:
    """Seconds this process has spent in full garbage collections (generation 2), counted by a
    ``gc`` callback. A full collection stops every thread for as long as the heap takes to scan
    (about 10 to 20 ms in a server process): a run it fell into is not the model being slow."""

    seconds = 0.0
    _began = 0.0
    # Held here, not looked up in the module: the interpreter's last collections, at exit, run
    # after module globals are cleared.
    _clock = staticmethod(time.perf_counter)

    @classmethod
    def callback(cls, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                cls._began = cls._clock()
            else:
                cls.seconds += cls._clock() - cls._began


gc.callbacks.append(FullCollections.callback)


@atexit.register
def _unhook_full_collections() -> None:
    """Unhooked at exit, before the interpreter tears modules down: a collection during that
    teardown could call it half torn down and print "Exception ignored in: ..." with a traceback."""
    if FullCollections.callback in gc.callbacks:
        gc.callbacks.remove(FullCollections.callback)


__all__ = ["FullCollections"]
