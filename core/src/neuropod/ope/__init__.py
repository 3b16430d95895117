"""Out-of-process execution: a model in its own worker process(es).

``load_neuropod(path, use_ope=True)`` (and any model whose chosen backend lives
in a backend environment) returns a :class:`~neuropod.ope.worker_model.WorkerModel`:
the same ``infer``, spec checks and errors as in-process, with the model loaded
in a worker started from the backend's Python. Tensors cross through shared memory (see
:mod:`neuropod.ope._channel`); only names, dtypes, shapes, offsets and block
ids cross the control channel.

The parts: :mod:`neuropod.ope.pool` (a model's workers, :func:`start_pool`),
:mod:`neuropod.ope.process` (one worker process, seen from the caller),
:mod:`neuropod.ope.fingerprint` (the package files a restart must find again),
:mod:`neuropod.ope._channel` (the channel and the shared-memory blocks),
:mod:`neuropod.ope.streaming` (a decoupled model's stream from a worker),
:mod:`neuropod.ope.sequences` (a stateful model's sequences, whose state the workers keep),
:mod:`neuropod.ope.worker` (the worker's own side) and
:mod:`neuropod.ope.worker_model` (the model class).

* A decoupled model's ``infer_stream`` runs its generator in a worker, one
  response per ``next`` of the caller (see :mod:`neuropod.ope.streaming`):
  each response is copied out of the worker's block as it arrives, and a
  stream holds its worker from its first response to its end.
* A stateful model's sequences keep their state in the worker that ran their first step (see
  :mod:`neuropod.ope.sequences`): a step's inputs and outputs cross, its state does not.
* Inputs are copied once into one block per worker that is reused across
  calls (grown when a call needs more), or not at all when they were made
  with :meth:`~neuropod.ope.worker_model.WorkerModel.empty`. Outputs come back as numpy arrays over
  one shared block per call, with no copy after the worker's; a block is
  reused only once no array over it (or over a view of it) is left. A
  mapped block holds no file descriptor, so a call with hundreds of tensors
  needs no more descriptors than a call with one; each ``empty()`` array
  keeps one (to hand its block to a restarted worker) until it is
  garbage-collected, and the workers then unmap it too.
* String tensors cross as UTF-8 bytes and offsets, so one long string does
  not pad the others, and every character (NUL included, trailing or not)
  arrives as sent. Each side gets the kind of array the other gave: numpy
  unicode stays unicode, an object array of ``str`` stays one (numpy unicode
  arrays cannot hold a trailing NUL; use object arrays for such strings).
* A worker that dies gives a :class:`~neuropod.errors.WorkerError` at once,
  with its exit status and the end of its stderr. ``timeout=`` bounds each
  call: a worker that has not answered within it is killed, and the call
  raises a WorkerError within the timeout plus a few milliseconds. Then,
  with ``restart=True``, the next call starts a new worker (and waits for it
  to load the model: the timeout bounds answers, not loading); without it,
  every later call raises a WorkerError saying why the worker stopped.
* A restart serves the model that was first loaded or none: before a new
  worker starts, the package's files are checked against the manifest read
  at the first load (or, for packages without a manifest, such as original
  0.3 ones, against the sha256 of every file taken at the first load), and a
  changed, added or missing file is a :class:`~neuropod.errors.PackageError`
  naming it. Load the model again to serve the files as they are now.
* Workers live as long as the process that loaded them, whichever thread
  did: the kernel kills a worker the moment that process exits or is killed,
  even mid-inference (see :mod:`neuropod.ope.worker`). A model dropped
  without ``close()`` stops its workers when it is garbage-collected, and
  at interpreter exit.
* A model cannot cross ``fork()``: in a forked child, ``infer`` and
  ``empty`` raise a WorkerError saying so (load the model again in the
  child), and the child's exit leaves the parent's workers alone.
* When a system limit stops shared memory or a worker (open files, memory),
  the WorkerError names the limit and its current value.
"""

from neuropod.ope.pool import WorkerPool, start_pool

# WorkerModel (neuropod.ope.worker_model) is not re-exported here: a worker process starts with
# `python -m neuropod.ope.worker`, which runs this file, and needs none of the model layer.
__all__ = ["WorkerPool", "start_pool"]
