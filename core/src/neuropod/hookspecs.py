"""The hook specification: the contract between the core and backend plugins.

A backend plugin is a module with implementations of these hooks, marked with
:data:`neuropod.hookimpl`, registered under the entry-point group
``neuropod.backends``::

    [project.entry-points."neuropod.backends"]
    onnx = "neuropod_onnx"

Rules every implementation keeps:

* Importing the plugin module imports no framework; ``supported_versions``
  and ``device_caps`` read package metadata only. Frameworks are imported
  inside ``load_model``.
* An implementation may accept a subset of a hook's arguments; hooks grow
  only by adding arguments, so older plugins keep working.
* ``device_caps``, ``load_model`` and ``infer`` are called with a backend or
  model of this plugin's own; the core binds the plugin that loaded a model,
  so ``infer`` is not broadcast to every plugin. Each returns ``None`` for
  something that is not its own, as firstresult hooks do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import numpy as np

    from neuropod.backend import Backend, DeviceCaps
    from neuropod.package import Package

hookspec = pluggy.HookspecMarker("neuropod")
hookimpl = pluggy.HookimplMarker("neuropod")


@hookspec
def supported_versions() -> Sequence[Backend]:
    """Return the backends this plugin can run in this Python environment.

    Read the installed framework's version from package metadata (for
    example ``importlib_metadata.version("onnxruntime")``) without importing
    the framework.

    :returns: one :class:`~neuropod.backend.Backend` per installed framework
        build (usually zero or one); empty when the framework is not installed.
    """


@hookspec(firstresult=True)
def device_caps(backend: Backend) -> DeviceCaps | None:
    """Return what ``backend`` can run on: CPU, and CUDA with its version and
    compute capabilities.

    Called only for backends this plugin returned from
    :func:`supported_versions`. Must not import the framework.

    :param backend: one of this plugin's backends.
    :returns: a :class:`~neuropod.backend.DeviceCaps`, or None when the backend
        is not this plugin's. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Load ``package`` with ``backend`` onto ``device`` and return a handle.

    The handle is any object this plugin's :func:`infer` understands. If it
    has a ``close()`` method, the core calls it when the model is closed.
    Load the package's custom ops (``package.custom_op_paths``) before the
    model. Raise :class:`~neuropod.errors.NeuropodError` for a problem the
    user can fix; any other exception is wrapped by the core as a
    :class:`~neuropod.errors.BackendError` naming the model and backend.

    :param package: the checked package (config, spec, files).
    :param backend: the backend resolution chose; one of this plugin's.
    :param device: ``"cpu"`` or ``"cuda:N"``.
    :param options: backend-specific load options the user passed to
        :func:`neuropod.load_neuropod` (unknown ones should be an error).
    :returns: the model handle, or None when the backend is not this plugin's.
        Stops at first non-None result.
    """


@hookspec(firstresult=True)
def infer(
    model: Any,
    inputs: Mapping[str, np.ndarray],
    requested_outputs: Sequence[str] | None,
    output_device: str | None,
    parameters: Mapping[str, Any] | None,
) -> Any:
    """Run a model this plugin loaded on one set of inputs.

    The core has already checked ``inputs`` against the input spec (names,
    dtypes, shapes, symbols; arrays are C-contiguous; string tensors are
    numpy unicode or object arrays of ``str``) and checks the returned
    outputs against the output spec afterwards.

    Device tensors (optional): a backend whose :func:`device_caps` says
    ``device_tensors=True`` and whose ``infer`` takes ``output_device`` may
    also get inputs that live on the model's GPU, as the caller passed them
    (a torch CUDA tensor, or any object with ``__dlpack__`` or
    ``__cuda_array_interface__``; already checked from their metadata, see
    :mod:`neuropod.tensors`); ``inputs`` is then a
    :class:`~neuropod.tensors.DeviceInputs` dict, and only then. Other
    backends only ever get numpy arrays.

    :param model: a handle returned by this plugin's :func:`load_model`.
    :param inputs: input name to numpy array (or device tensor, above);
        inputs the caller left out are absent.
    :param requested_outputs: output names to compute, or None for all.
    :param output_device: None: return numpy arrays. ``"cuda:N"`` (the
        model's own GPU): leave numeric outputs there as the framework's
        tensors, which must support ``__dlpack__``; strings stay numpy.
    :param parameters: request parameters for the model (str to bool, int, float or
        str), from :meth:`NeuropodModel.infer(parameters=...) <neuropod.model.NeuropodModel.infer>`
        or a served request's ``parameters``. Declare it with a default
        (``parameters=None``): calls without parameters then leave it out, so
        the per-call path stays as it was. A backend that does not declare it
        never gets them (the model runs as without them).

        .. versionadded:: 0.4 (request parameters)
    :returns: ``dict`` of output name to numpy array (or device tensor).
        Stops at first non-None result.
    """


@hookspec(firstresult=True)
def infer_stream(
    model: Any,
    inputs: Mapping[str, np.ndarray],
    requested_outputs: Sequence[str] | None,
    parameters: Mapping[str, Any] | None,
) -> Iterator[Mapping[str, np.ndarray]] | None:
    """Run a *decoupled* model this plugin loaded on one set of inputs: its responses, as they come.

    Optional. A package whose ``config.json`` says ``"decoupled": true`` answers each request
    with zero or more responses; only a backend whose plugin implements this hook loads one
    (the others are refused at load, naming the plugin). A plugin opts in by adding it; plugins
    without it are unchanged, and :func:`infer` is never called for a decoupled model.

    The core checks ``inputs`` as for :func:`infer`, then iterates what this returns: each
    item is a dict of output name to numpy array holding some or all of the outputs (the
    core keeps only ``requested_outputs`` when given, and checks each response against the
    output spec as it comes). The core may stop early: it calls the iterator's ``close()``
    (a generator's ``finally`` then runs), from the thread that iterated it, once it is not
    running. Raise :class:`~neuropod.errors.NeuropodError` (or any exception, wrapped by the
    core as a :class:`~neuropod.errors.BackendError`) to end the stream with an error; the
    responses already produced have been delivered.

    The core reads the iterator one response per ``next`` of the caller's stream, so do the
    work inside it (a generator), not in the hook itself. In a worker process (``use_ope=True``,
    backend environments) the hook runs in the worker and each response crosses to the caller
    when it is read: responses then hold numeric, bool or string arrays only.

    :param model: a handle returned by this plugin's :func:`load_model`.
    :param inputs: input name to numpy array.
    :param requested_outputs: output names wanted, or None for all.
    :param parameters: request parameters, as for :func:`infer` (declare it with a default).
    :returns: an iterator of output dicts (a generator is the usual one), or None when the
        model is not this plugin's. Stops at first non-None result.

    .. versionadded:: 0.4 (streaming)
    """


__all__ = ["device_caps", "hookimpl", "hookspec", "infer", "infer_stream", "load_model", "supported_versions"]
