"""WorkerModel: a NeuropodModel whose backend runs in worker processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SpecError
from neuropod.model import NeuropodModel
from neuropod.ope import _Pool
from neuropod.package import Package
from neuropod.resolve import Resolution
from neuropod.spec import DTYPES


class WorkerModel(NeuropodModel):
    """A model loaded in worker process(es): the same ``infer``, specs and errors.

    Extra: :meth:`empty` hands out input arrays in shared memory (filling one
    and passing it to ``infer`` costs no copy), :attr:`worker_pids`.
    """

    def __init__(self, package: Package, resolution: Resolution, pool: _Pool):
        self._pool = pool
        super().__init__(package, resolution, pool)

    def _bind_infer(self) -> None:
        pool = self._pool
        self._infer = lambda _handle, inputs, requested: pool.infer(inputs, requested)
        self._infer_args = ("model", "inputs", "requested_outputs")

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [w.proc.pid for w in self._pool.workers if w.proc is not None and w.alive]

    @property
    def python(self) -> str:
        """The interpreter the workers run."""
        return self._pool.python

    def empty(self, name: str, shape: Sequence[int], dtype: Any = None) -> np.ndarray:
        """An uninitialised input array in shared memory: fill it, pass it to :meth:`infer`, no copy.

        :param name: the input it is for (its dtype is the default).
        """
        spec = next((s for s in self.inputs if s.name == name), None)
        if spec is None:
            raise SpecError(f"Model {self.name!r} has no input named {name!r}; its inputs are: "
                            + ", ".join(s.name for s in self.inputs))  # fmt: skip
        np_dtype = DTYPES[spec.dtype] if dtype is None else np.dtype(dtype)
        if np_dtype is None:
            raise NeuropodError(f"Input {name!r} is a string tensor; give empty() a dtype such as '<U16'")
        return self._pool.empty(tuple(int(d) for d in shape), np_dtype)

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return f"{base} in {len(self._pool.workers)} worker(s)>"


def options_for_worker(options: Mapping[str, Any]) -> dict[str, Any]:
    """Load options must cross to the worker as plain values."""
    for key, value in options.items():
        if not isinstance(value, (bool, int, float, str, type(None))):
            raise NeuropodError(f"Load option {key}={value!r} cannot be sent to a worker: use a bool, number or string")
    return dict(options)
