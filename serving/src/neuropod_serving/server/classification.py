"""Triton's classification extension: a requested output answered as its top classes.

A requested output with the parameter ``classification: k`` gets, instead of the
tensor, a BYTES tensor of the ``k`` highest entries of each row, highest first,
as ``"score:index"``, or ``"score:index:label"`` when the package has labels for
that output (``output_labels`` in its ``config.json``). When the output's first
dim is the model's batch dimension (the spec's batch symbol, see
:func:`~neuropod_serving.server.batching.batch_symbol`), each row ranks on its
own and the answer is ``[rows, k]``; otherwise the whole tensor is one row and
the answer is ``[k]``. A row with fewer than ``k`` entries answers all of them.

Ranking a large output takes time (about 1 s for all 1.5 M entries of one, 25 ms for its top
5): a request on the event loop ranks its outputs there only when they are small
(:data:`INLINE_ENTRIES`), and in a worker thread otherwise, so that health checks and other
requests keep being answered; :func:`answers_small` tells the front end the same of encoding
the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from neuropod.errors import SpecError
from neuropod_serving.protocol.options import RequestOptions, classify
from neuropod_serving.server.batching import batch_symbol
from neuropod_serving.server.registry import ServedModel

#: Outputs of up to this many entries (all classified outputs of a request together) are ranked
#: on the event loop, and answers of up to this many classes encoded there: a thread hop costs
#: more (ranking and formatting take about 0.4 µs an entry).
INLINE_ENTRIES = 4096


class Classifier:
    """The classification one request asks of its outputs, checked against the model."""

    __slots__ = ("batched", "counts", "labels")

    def __init__(
        self, counts: Mapping[str, int], batched: Mapping[str, bool], labels: Mapping[str, tuple[str, ...]]
    ) -> None:
        self.counts = counts
        self.batched = batched
        self.labels = labels

    @classmethod
    def of(cls, served: ServedModel, counts: Mapping[str, int], requested: list[str] | None) -> Classifier:
        """:raises SpecError: an output that is not the model's, or not numeric, named."""
        model = served.model
        specs = {s.name: s for s in model.outputs}
        symbol, _ = batch_symbol(model.inputs, model.outputs)
        batched: dict[str, bool] = {}
        for name in counts:
            spec = specs.get(name)
            if spec is None:
                raise SpecError(
                    f"output {name!r} asked for classification is not an output of model {served.name!r}; "
                    f"its outputs are: {', '.join(specs) or '(none)'}"
                )
            if spec.dtype == "string":
                raise SpecError(
                    f"output {name!r} of model {served.name!r} is a string tensor ({spec}): classification "
                    "ranks the entries of a numeric output"
                )
            batched[name] = symbol is not None and bool(spec.shape) and spec.shape[0] == symbol
        package = getattr(model, "package", None)
        config = getattr(package, "config", None)
        labels = getattr(config, "output_labels", None) or {}
        return cls(counts, batched, labels)

    def apply(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """``outputs`` with each classified output replaced by its classes (a BYTES tensor)."""
        counts = self.counts
        return {
            name: classify(np.asarray(array), counts[name], self.labels.get(name), self.batched[name])
            if name in counts
            else array
            for name, array in outputs.items()
        }

    async def apply_async(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """:meth:`apply`, in a worker thread unless the classified outputs are small."""
        if sum(np.size(outputs[name]) for name in self.counts if name in outputs) <= INLINE_ENTRIES:
            return self.apply(outputs)
        return await asyncio.get_running_loop().run_in_executor(None, self.apply, outputs)


def answers_small(options: RequestOptions | None, outputs: Mapping[str, Any]) -> bool:
    """Whether the classes a request asked (if any) in its ``outputs`` are few enough to encode
    on the event loop (see :data:`INLINE_ENTRIES`)."""
    counts = options.classification if options is not None else None
    return counts is None or sum(np.size(outputs[name]) for name in counts if name in outputs) <= INLINE_ENTRIES


__all__ = ["INLINE_ENTRIES", "Classifier", "answers_small"]
