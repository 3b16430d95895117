"""Whether a model's request may run on the event loop, learnt from its runs: a model that proved
fast (in process, recent runs under :data:`INLINE_BELOW_S`) runs where a thread hop would cost more
than the model; one that was once slow (:data:`SLOW_RUN_S`) never again
(see :meth:`~neuropod_serving.server.engine.Engine.infer`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from neuropod_serving.server.full_collections import FullCollections

if TYPE_CHECKING:
    from neuropod_serving.server.lifecycle import Runner

#: A model whose recent runs took less than this can run on the event loop's
#: thread. Handing a request to a thread and back costs 50 to 250 µs on a busy
#: core (the result wakes the loop through its self-pipe; measured on the
#: 100-input model of bench_serve.py, 0.26 ms a run: 0.96 -> 0.73 ms a request
#: inline), while holding the loop for under a millisecond delays nothing a
#: network client would notice. Slower models run in threads.
INLINE_BELOW_S = 0.001
#: A run that took this long after its model proved fast (a framework's first
#: runs are slow, and do not count) moves the model off the event loop for
#: good: a model that was once this slow may be again, and while it runs on the
#: loop nothing else (health probes included) is answered. A run counts when
#: at least half of it was CPU time of the thread that ran it, so a fast run
#: that a busy core kept waiting does not count, and full garbage collections
#: that fell into a run are not counted as its time.
SLOW_RUN_S = 0.02
#: Weight of the newest run in the moving average of a model's run time.
EWMA = 0.2


def learn(
    runner: Runner, inputs: Mapping[str, np.ndarray], started: float, cpu: float, collected: float, on_thread: bool
) -> float:
    """Learn from a run of ``runner``'s model begun at ``started`` (``cpu``: the thread's CPU
    time then, ``collected``: :class:`FullCollections` seconds then) whether it may run on the
    event loop (:attr:`~.lifecycle.Runner.inline_ok`, ``ewma_s``, ``inline_bytes``); the run's seconds.

    :param on_thread: the run was not on the event loop (only such runs raise ``inline_bytes``).
    """
    seconds = time.perf_counter() - started
    # The model's own time: without the full collections the run fell into (whichever thread
    # ran them, every thread waited); the metrics keep what the request took.
    ran = seconds - (FullCollections.seconds - collected)
    # Slow on this thread's CPU too: the model's own work, not a busy core's scheduling.
    if (
        ran >= SLOW_RUN_S
        and runner.ewma_s < INLINE_BELOW_S
        and time.thread_time() - cpu - (seconds - ran) >= SLOW_RUN_S / 2
    ):
        runner.inline_ok = False
    elif on_thread and ran < INLINE_BELOW_S and runner.inline_ok:
        # Learnt on threads; a run on the loop had no larger input than this already.
        size = nbytes(inputs)
        if size > runner.inline_bytes:
            runner.inline_bytes = size
    runner.ewma_s += EWMA * (ran - runner.ewma_s)
    return seconds


def nbytes(inputs: Mapping[str, np.ndarray]) -> int:
    """The size of the first input (0 for none): what :attr:`~.lifecycle.Runner.inline_bytes` compares."""
    for a in inputs.values():
        return int(a.nbytes)
    return 0


__all__ = ["EWMA", "INLINE_BELOW_S", "SLOW_RUN_S", "learn", "nbytes"]
