"""Checks of public arguments shared by ``load_neuropod`` and ``neuropod.ope``.

A wrong type is a ``TypeError`` and a wrong value a ``ValueError``, each
naming the argument, raised before any work starts.
"""

from __future__ import annotations

import math
import numbers
import threading

import numpy as np


def check_flag(name: str, value: object) -> None:
    """``value`` is a bool (numpy's too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r:.60}")


def check_seconds(name: str, value: object) -> None:
    """``value`` is None or a positive, finite number of seconds a wait can take."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, not {type(value).__name__} {value!r:.60}")
    # Beyond threading.TIMEOUT_MAX (~292 years) waits raise OverflowError deep in the standard library.
    seconds = float(value)
    if not (math.isfinite(seconds) and 0 < seconds <= threading.TIMEOUT_MAX):
        raise ValueError(
            f"{name} must be a positive, finite number of seconds (None waits as long as it takes), not {value!r}"
        )


def check_workers(value: object) -> None:
    """``value`` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"workers must be an int >= 1, not {type(value).__name__} {value!r:.60}")
    if int(value) < 1:
        raise ValueError(f"workers must be at least 1, not {value}")


def check_parameters(value: object) -> None:
    """``value`` is a mapping of non-empty str to bool, int, float, str or None: request
    parameters, as the Open Inference Protocol's ``parameters`` can carry them."""
    from collections.abc import Mapping

    if not isinstance(value, Mapping):
        raise TypeError(f"parameters must be a mapping of str to bool, int, float or str, not {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"parameters: a key must be a non-empty str, not {key!r:.60}")
        if item is not None and not isinstance(item, (bool, int, float, str)):
            raise TypeError(
                f"parameters[{key!r}] must be a bool, int, float or str (the protocol's parameter types), "
                f"not {type(item).__name__}"
            )
