"""Calling a plugin's hooks: the implementation in the plugin that offers a backend, called with
the arguments it declares; what a backend can run on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from neuropod.backend import Backend, DeviceCaps
from neuropod.errors import NoBackendError
from neuropod.plugins.registry import get_plugin_manager, plugin_info, record_failure


def _impl(hook_name: str, plugin: str) -> Callable[..., Any]:
    """The function implementing ``hook_name`` in one plugin, called with
    only the arguments it declares."""
    pm = get_plugin_manager()
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin:
            func, argnames = impl.function, tuple(impl.argnames)

            def call(func: Callable[..., Any] = func, argnames: tuple[str, ...] = argnames, **kwargs: Any) -> Any:
                return func(**{k: kwargs[k] for k in argnames})

            call.function = func  # type: ignore[attr-defined]
            call.argnames = argnames  # type: ignore[attr-defined]
            # Arguments declared with a default (``parameters=None``): passed only when there are some.
            call.kwargnames = tuple(getattr(impl, "kwargnames", ()))  # type: ignore[attr-defined]
            return call
    raise NoBackendError(f"Plugin {plugin!r} does not implement the {hook_name!r} hook")


def bound_hook(hook_name: str, backend: Backend) -> Callable[..., Any]:
    """The implementation of a hook in the plugin that offers ``backend``.

    :raises NoBackendError: ``backend`` lives elsewhere (a backend
        environment, a described host): its plugin in this process would run
        this environment's framework, not that one's.
    """
    if backend.location != "in-process":
        raise NoBackendError(
            f"Backend {backend.id} lives in {backend.location}, not in this process; "
            "it runs in a worker process started from there (load_neuropod does that)"
        )
    return _impl(hook_name, backend.plugin)


_INFER_ARGS = ("model", "inputs", "requested_outputs")
#: The ``infer`` hook's arguments when an implementation takes ``output_device`` too, in this order.
INFER_ARGS_WITH_DEVICE = (*_INFER_ARGS, "output_device")


def infer_caller(impl: Any) -> Callable[[Any, Any, Any], Any]:
    """A plugin's ``infer`` implementation (from :func:`bound_hook`) as ``call(model, inputs, requested_outputs)``.

    Hooks grow by adding arguments and a plugin may take any of them, so this
    passes each what it takes (``output_device`` as None: numpy outputs), with
    no per-call work for the common signatures.
    """
    fn, args = impl.function, tuple(impl.argnames)
    if args == _INFER_ARGS:
        return fn  # type: ignore[no-any-return]
    if args == INFER_ARGS_WITH_DEVICE:
        # A partial, not a lambda: no Python frame of ours between the model and the plugin.
        return functools.partial(fn, output_device=None)

    def call(model: Any, inputs: Any, requested: Any) -> Any:
        values = {"model": model, "inputs": inputs, "requested_outputs": requested, "output_device": None,
                  "parameters": None}  # fmt: skip
        return fn(**{k: values[k] for k in args})

    return call


def parameters_caller(impl: Any) -> Callable[[Any, Any, Any, Any], Any] | None:
    """A plugin's ``infer`` implementation as ``call(model, inputs, requested_outputs, parameters)``
    when it takes ``parameters`` (request parameters for the model), else None."""
    fn = impl.function
    declared = (*impl.argnames, *getattr(impl, "kwargnames", ()))
    if "parameters" not in declared:
        return None
    takes_device = "output_device" in declared

    def call(model: Any, inputs: Any, requested: Any, parameters: Any) -> Any:
        if takes_device:
            return fn(
                model=model, inputs=inputs, requested_outputs=requested, output_device=None, parameters=parameters
            )
        return fn(model=model, inputs=inputs, requested_outputs=requested, parameters=parameters)

    return call


def stream_caller(impl: Any) -> Callable[[Any, Any, Any, Any], Any]:
    """A plugin's ``infer_stream`` implementation (from :func:`bound_hook`) as
    ``call(model, inputs, requested_outputs, parameters)``, passing each what it declares
    (``parameters`` only when there are some, to one declared with a default)."""
    fn = impl.function
    declared = (*impl.argnames, *getattr(impl, "kwargnames", ()))

    def call(model: Any, inputs: Any, requested: Any, parameters: Any) -> Any:
        values = {"model": model, "inputs": inputs, "requested_outputs": requested, "parameters": parameters}
        if not parameters and "parameters" not in impl.argnames:
            values.pop("parameters")
        return fn(**{k: values[k] for k in declared if k in values})

    return call


def backend_caps(backend: Backend) -> DeviceCaps:
    """What ``backend`` can run on; CPU only if its plugin does not say.

    Asked of the plugin that reported the backend even when the backend runs
    elsewhere (e.g. the python plugin's other interpreters): ``device_caps``
    reads metadata only, never the framework.
    """
    try:
        caps = _impl("device_caps", backend.plugin)(backend=backend)
    except NoBackendError:
        return DeviceCaps(cpu=True, note="plugin does not report device_caps")
    except Exception as e:  # noqa: BLE001 - as above
        info = plugin_info(backend.plugin)
        record_failure(backend.plugin, info.distribution if info else "(unknown)", f"device_caps failed: {e}")
        return DeviceCaps(cpu=False, note=f"device_caps failed: {e}")
    return caps if isinstance(caps, DeviceCaps) else DeviceCaps(cpu=True)
