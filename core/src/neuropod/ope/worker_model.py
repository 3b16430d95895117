"""WorkerModel: a NeuropodModel whose backend runs in worker processes."""

from __future__ import annotations

import math
import operator
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SpecError
from neuropod.model import NeuropodModel
from neuropod.ope.pool import WorkerPool
from neuropod.ope.sequences import WorkerSequences
from neuropod.ope.streaming import WorkerStream
from neuropod.package import Package
from neuropod.resolve import Resolution
from neuropod.sequences import SequenceStep
from neuropod.spec import DTYPES


class WorkerModel(NeuropodModel):
    """A model loaded in worker process(es): the same ``infer`` (and ``infer_stream``, whose
    generator runs in a worker: see :mod:`neuropod.ope.streaming`), specs and errors.

    Extra: :meth:`empty` hands out input arrays in shared memory (filling one
    and passing it to ``infer`` costs no copy), :attr:`worker_pids`, :attr:`worker_run_time`,
    :attr:`worker_sequences`.

    A stateful model's sequences keep their state in the workers (see :mod:`neuropod.ope.sequences`):
    a step sends the caller's inputs and gets the caller's outputs, and ``seq.state()`` copies a
    state back from its worker.

    A model dropped without :meth:`close` stops its workers when it is
    garbage-collected, or at interpreter exit.
    """

    def __init__(self, package: Package, resolution: Resolution, pool: WorkerPool):
        self._pool = pool
        super().__init__(package, resolution, pool)
        # The pool, not the model: the finalizer must not keep the model alive.
        weakref.finalize(self, pool.close)
        self._in_workers: WorkerSequences | None = None
        if self._sequences is not None:
            if not pool.pinned:
                raise NeuropodError(f"Model {self.name!r} is stateful, but its workers were started without its sequences")
            table = self._sequences
            self._initial = [table.initial[p.input_name] for p in table.pairs]
            # The books only: the workers keep the state, and each step goes to its sequence's worker.
            self._sequences = self._in_workers = WorkerSequences(table, pool)
            # The common step's path (see NeuropodModel.infer) with this table's run_one, which
            # sends the step to the sequence's worker; none if that path is not as expected.
            fast = self._fast_step
            self._fast_step = None if fast is None or fast[1] is not table else (fast[0], self._in_workers, *fast[2:])

    def _workers_table(self) -> WorkerSequences:
        self._stateful_table()  # closed, or not stateful: says so
        assert self._in_workers is not None
        return self._in_workers

    def _run_steps(
        self, inputs: dict[str, Any], requested: list[str] | None, steps: list[SequenceStep],
        parameters: Mapping[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        return self._workers_table().run(inputs, requested, steps, parameters)

    def _end_sequence(self, sequence_id: int | str) -> bool:
        return self._workers_table().end_sequence(sequence_id)

    def _sequence_state(self, sequence_id: int | str) -> dict[str, Any]:
        return self._workers_table().copy_state(sequence_id)

    def _initial_states(self) -> list[Any]:
        self._workers_table()
        return self._initial

    @property
    def worker_sequences(self) -> list[int]:
        """How many sequences each worker holds the state of now (a stateful model; asks each
        worker, waiting for a call it runs)."""
        return self._workers_table().worker_counts()

    def _bind_infer(self) -> None:
        pool = self._pool
        self._infer = lambda _handle, inputs, requested: pool.infer(inputs, requested)
        # Request parameters go to the worker, whose backend takes them or not (as in-process).
        self._infer_with_parameters = lambda _handle, inputs, requested, parameters: pool.infer(
            inputs, requested, parameters
        )

    def _bind_stream(self) -> Callable[[Any, Any, Any, Any], Any]:
        # The worker bound the backend's infer_stream when it loaded the model (or refused it).
        pool = self._pool
        return lambda _handle, inputs, requested, parameters: WorkerStream(pool, inputs, requested, parameters)

    def _no_device_tensors(self) -> str:
        return (
            "the model runs in a worker process (use_ope=True, or a backend or lock environment), and tensors reach "
            "it through shared host memory. Pass numpy arrays (or CPU tensors), or load the model in this process"
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [w.proc.pid for w in self._pool.workers if w.proc is not None and w.alive]

    @property
    def worker_run_time(self) -> tuple[int, float]:
        """Calls the workers have answered, and the seconds the backend spent running the model for
        them, measured in the workers: the rest of a call's time is its round trip to a worker."""
        return self._pool.runs, self._pool.run_s

    @property
    def python(self) -> str:
        """The interpreter the workers run."""
        return self._pool.python

    def empty(self, name: str, shape: int | Sequence[int], dtype: Any = None) -> np.ndarray:
        """An uninitialised input array in shared memory: fill it, pass it to :meth:`infer`, no copy.

        :param name: the input it is for.
        :param shape: its shape (ints >= 0).
        :param dtype: the input's dtype by default; another must be the same.
            String inputs need a numpy unicode dtype such as ``'<U16'`` (they
            are encoded on each call, so for them this saves nothing).
        :raises SpecError: the model has no such input.
        :raises TypeError, ValueError: a shape or dtype that is not one, or
            does not fit the input or this machine's memory; raised before
            any memory is allocated.
        """
        spec = next((s for s in self.inputs if s.name == name), None)
        if spec is None:
            raise SpecError(f"Model {self.name!r} has no input named {name!r}; its inputs are: "
                            + ", ".join(s.name for s in self.inputs))  # fmt: skip
        dims = _check_shape(shape)
        np_dtype = _check_dtype(name, spec.dtype, dtype)
        nbytes = math.prod(dims) * np_dtype.itemsize
        limit = _memory_bytes()
        if nbytes > limit:
            raise ValueError(
                f"empty({name!r}): shape {dims} of {np_dtype} is {nbytes} bytes, more than this machine's "
                f"memory ({limit} bytes)"
            )
        return self._pool.empty(dims, np_dtype)

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return f"{base} in {len(self._pool.workers)} worker(s)>"


def _check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0 (an int is a 1-d shape); TypeError or ValueError naming it otherwise."""
    items = (shape,) if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool) else shape
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence | np.ndarray):
        raise TypeError(f"empty(): shape must be a tuple of ints, not {type(shape).__name__} {shape!r:.60}")
    dims = []
    for i, d in enumerate(items):
        if isinstance(d, (bool, np.bool_)):
            raise TypeError(f"empty(): shape[{i}] is {d!r}; a dim is an int >= 0")
        try:
            n = operator.index(d)
        except TypeError:
            raise TypeError(f"empty(): shape[{i}] is {type(d).__name__} {d!r:.40}; a dim is an int >= 0") from None
        if n < 0:
            raise ValueError(f"empty(): shape[{i}] is {n}; a dim is an int >= 0")
        dims.append(n)
    return tuple(dims)


def _check_dtype(name: str, spec_dtype: str, dtype: Any) -> np.dtype[Any]:
    """The dtype of an ``empty()`` array for input ``name``: the spec's, or ``dtype`` when it fits it."""
    wanted: np.dtype[Any] | None = DTYPES[spec_dtype]
    if spec_dtype == "bytes":  # an object array: its elements live in Python, not in shared memory
        raise ValueError(
            f"empty(): input {name!r} is a bytes tensor, which shared memory cannot hold as an array; "
            "pass an object array of bytes (neuropod.spec.to_bytes_array) to infer"
        )
    if dtype is None:
        if wanted is None:
            raise ValueError(f"empty(): input {name!r} is a string tensor; give a dtype such as '<U16'")
        return wanted
    try:
        np_dtype: np.dtype[Any] = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"empty(): dtype {dtype!r:.60} is not a numpy dtype ({e})") from None
    if wanted is None:
        if np_dtype.kind != "U" or np_dtype.itemsize == 0:
            raise ValueError(f"empty(): input {name!r} is a string tensor; dtype must be numpy unicode such as '<U16', not {np_dtype}")
    elif np_dtype != wanted:
        raise ValueError(f"empty(): input {name!r} is {spec_dtype}, so dtype must be {wanted} (or None), not {np_dtype}")
    return np_dtype


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 48


def options_for_worker(options: Mapping[str, Any]) -> dict[str, Any]:
    """Load options must cross to the worker as plain values."""
    for key, value in options.items():
        if not isinstance(value, (bool, int, float, str, type(None))):
            raise NeuropodError(f"Load option {key}={value!r} cannot be sent to a worker: use a bool, number or string")
    return dict(options)


__all__ = ["WorkerModel", "options_for_worker"]
