"""Loading a model: :func:`load_neuropod` and :func:`plan` (the original Neuropod's import path,
``from neuropod.loader import load_neuropod``).

A package is read (or downloaded, see :mod:`neuropod.storage`), resolved against the installed
backends and those of the backend environments, and loaded in this process
(:class:`~neuropod.model.NeuropodModel`), in worker processes (:mod:`neuropod.ope`), or handed to a
remote-model handler for a URL (:mod:`neuropod.remote`).
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from neuropod import plugins, remote, storage
from neuropod._args import check_flag, check_seconds, check_workers
from neuropod.devices import Host, load_host, local_host, parse_device
from neuropod.envs import environment_backends, get_environment, lock_environment
from neuropod.errors import BackendError, InProcessConflictError, NeuropodError, NoBackendError, PackageError
from neuropod.model import NeuropodModel, framework_error
from neuropod.ope import start_pool
from neuropod.ope.worker_model import WorkerModel, options_for_worker
from neuropod.package import Package, read_package
from neuropod.pipelines import STEP_LOAD_ARGS, PipelinePlan, load_pipeline, plan_pipeline
from neuropod.pipespec import PIPELINE_PLATFORM
from neuropod.resolve import Resolution, parse_backend_pin, resolve
from neuropod.stateful import with_sequences


def _host(host: Host | str | os.PathLike[str] | None) -> Host:
    if host is None:
        return local_host()
    if isinstance(host, Host):
        return host
    return load_host(host)


# --- argument checks: wrong types and values fail before any file is read ---


def _check_path(name: str, value: object, *, package_ok: bool) -> None:
    if isinstance(value, (str, os.PathLike)) or (package_ok and isinstance(value, Package)):
        return
    expected = "a path (str or os.PathLike)" + (" or a Package" if package_ok else "")
    raise TypeError(f"{name} must be {expected}, not {type(value).__name__} {value!r:.60}")


def _check_resolution_args(device: object, backend: object, host: object = None) -> None:
    """``device``, ``backend`` and ``host`` as :func:`plan` and :func:`load_neuropod` take them."""
    if device is not None:
        if not isinstance(device, str):
            raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', or None, not {type(device).__name__} {device!r:.60}")
        parse_device(device)  # an unknown device is a NeuropodError naming the accepted forms
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(
                f"backend must be a str such as 'onnx' or 'onnx==1.31.1', or None, not {type(backend).__name__} {backend!r:.60}"
            )
        parse_backend_pin(backend)
    if host is not None and not isinstance(host, Host):
        _check_path("host", host, package_ok=False)


def plan(
    package: Package | str | os.PathLike[str],
    *,
    device: str | None = None,
    backend: str | None = None,
    host: Host | str | os.PathLike[str] | None = None,
) -> Resolution:
    """Resolve a package against the installed backends without loading it.

    :param host: the machine to plan for: a :class:`Host`, a host file, or
        None for this machine. A host file that lists ``backends`` is planned
        with those; otherwise with this environment's installed backends and
        those of the backend environments (:mod:`neuropod.envs`); an
        in-process backend wins over an environment's when both fit.
    """
    _check_path("package", package, package_ok=True)
    _check_resolution_args(device, backend, host)
    pkg = package if isinstance(package, Package) else read_package(package)
    target = _host(host)
    if pkg.config.pipeline is not None:
        _check_pipeline_pin(pkg, backend)
        # Each step is planned as a package of its own: a pipeline is its steps' plans.
        return plan_pipeline(pkg, target, lambda step: plan(step, device=device, host=target))
    if target.backends:  # a described machine with its own software
        caps = dict(target.backends)
        backends = list(caps)
    else:
        backends = plugins.installed_backends()
        caps = {b: plugins.backend_caps(b) for b in backends}
        for b, c in environment_backends():
            backends.append(b)
            caps[b] = c
    return resolve(pkg.config, backends, caps, target, device=device, backend=backend)


def load_neuropod(
    neuropod_path: str | os.PathLike[str] | Package | Sequence[str],
    *,
    device: str | None = None,
    backend: str | None = None,
    verify: bool = True,
    use_ope: bool = False,
    workers: int = 1,
    restart: bool = False,
    timeout: float | None = None,
    **load_options: Any,
) -> NeuropodModel:
    """Load a package with the best backend installed here.

    :param neuropod_path: a package directory or zip (or a :class:`Package` already read),
        the URL of one in an object store or on a web server (``s3://bucket/adder.neuropod``,
        a directory prefix ``s3://bucket/models/adder/``, ``gs://``, ``az://``, ``abfs://``,
        or an ``https://`` URL ending in ``.zip`` or ``.neuropod``: downloaded once per
        version of the object into the cache, see :mod:`neuropod.storage`; needs the
        core's extra for the store, e.g. ``pip install 'neuropod[s3]'``),
        or the URL of a model on an Open Inference Protocol server
        (``grpc://host:8001/model``, ``http://``, ``https://``, ``grpcs://``;
        a list of URLs spreads calls over several servers). Remote models need
        ``pip install 'neuropod-serving[client]'`` and take its options
        (``timeout``, ``retries``, ``auth_token``, ``tls``, ``ca_cert``...;
        see :func:`neuropod_serving.client.load`), not ``device``, ``backend``
        or the OPE options.
    :param device: ``"cpu"`` or ``"cuda:N"`` to force a device; by default a
        GPU when the model asks for one and one fits, else the CPU.
    :param backend: pin a backend, e.g. ``"onnx"`` or ``"onnx==1.31.1"``.
    :param verify: check the files against the package's manifest.
    :param use_ope: run the model in worker process(es) (out-of-process
        execution; see :mod:`neuropod.ope`). Models whose backend lives in a
        backend environment always do.
    :param workers: with OPE, how many worker processes share the calls.
    :param restart: with OPE, start a new worker on the next call after one died.
    :param timeout: with OPE, seconds each call may take: a worker that has
        not answered by then is killed and the call raises ``WorkerError``;
        with ``restart=True`` the next call starts a new worker (after checking
        the package is unchanged), else later calls raise. Loading is not
        bounded by it. None: wait as long as the model runs.
    :param load_options: ``storage_options`` (for a package URL: the fsspec filesystem's
        options, such as credentials or ``client_kwargs={"endpoint_url": ...}``); the rest are
        passed to the backend's ``load_model`` hook
        (for example thread counts); backends reject options they do not know.
        Two options of the original Neuropod are taken here: ``visible_gpu=N``
        (``device="cuda:N"``; ``None`` for the CPU) and ``load_custom_ops=False``
        (the caller has loaded the package's op libraries itself; in-process
        only, since a worker process starts without them).
    :raises TypeError, ValueError: an argument of the wrong type or value
        (raised before the package is read).
        A pipeline package (see :mod:`neuropod.pipelines`) loads each step with ``device``,
        ``use_ope``, ``workers``, ``restart``, ``timeout`` and ``verify``, plus
        ``step_options={"<step>": {...}}``: more ``load_neuropod`` keywords for one step (a
        backend's options, a ``backend`` pin, a served step's ``timeout`` or ``auth_token``).
        ``sequences={"state_spec": [...], "sequence_controls": [...]}`` makes the model stateful
        as if its package declared them (see :func:`~neuropod.stateful.with_sequences`; what ``neuropod serve`` does
        with a Triton configuration's ``sequence_batching``).
    :raises PackageError: the package is missing, malformed or changed.
    :raises NoBackendError: nothing here can run it; the message has the table.
    :raises BackendError: the framework failed to load the model.
    """
    storage_options = load_options.pop("storage_options", None)
    url = None
    if storage.is_package_url(neuropod_path):
        url = neuropod_path
        neuropod_path = storage.fetch(url, storage_options=storage_options)  # type: ignore[arg-type]
    elif storage_options is not None:
        raise ValueError(
            "storage_options applies to package URLs (s3://, gs://, az://, abfs://, or an http(s) URL of a .zip or "
            f".neuropod file), not to {neuropod_path!r:.100}"
        )
    if remote.is_remote(neuropod_path):
        return remote.load_remote(
            neuropod_path,  # type: ignore[arg-type]
            device=device, backend=backend, verify=verify, use_ope=use_ope, workers=workers, restart=restart,
            timeout=timeout, **load_options,
        )  # fmt: skip
    device = _original_load_options(load_options, device)
    sequences = load_options.pop("sequences", None)
    load_custom_ops = load_options.pop("load_custom_ops", True)
    check_flag("load_custom_ops", load_custom_ops)
    check_load_args(neuropod_path, device=device, backend=backend, verify=verify, use_ope=use_ope,
                     workers=workers, restart=restart, timeout=timeout)  # fmt: skip
    try:
        package = neuropod_path if isinstance(neuropod_path, Package) else read_package(neuropod_path, verify=verify)  # type: ignore[arg-type]  # a list is remote, above
    except PackageError as e:
        if url is None:
            raise
        raise storage.as_downloaded(e, neuropod_path, url) from None  # type: ignore[arg-type]
    if package.config.pipeline is not None:
        return _load_pipeline(package, sequences, load_options, device=device, backend=backend, verify=verify,
                              use_ope=use_ope, workers=workers, restart=restart, timeout=timeout)  # fmt: skip
    if sequences is not None:
        package = with_sequences(package, sequences)
    resolution = plan(package, device=device, backend=backend)
    chosen = resolution.raise_if_unresolved()
    if use_ope or chosen.backend.location != "in-process" or package.requirements_lock is not None:
        return _load_in_workers(package, resolution, load_options, workers=workers, restart=restart, timeout=timeout)
    load = plugins.bound_hook("load_model", chosen.backend)
    in_process = package
    if not load_custom_ops and package.config.custom_ops:
        # The caller has loaded the package's op libraries itself (the original's load_custom_ops=False).
        in_process = replace(package, config=replace(package.config, custom_ops=()))
    try:
        handle = load(package=in_process, backend=chosen.backend, device=chosen.device, options=dict(load_options))
    except InProcessConflictError as e:
        warnings.warn(f"{e}. Model {package.name!r} runs in a worker process instead (OPE).", UserWarning, stacklevel=2)
        return _load_in_workers(package, resolution, load_options, workers=workers, restart=restart, timeout=timeout)
    except NeuropodError:
        raise
    except Exception as e:
        raise BackendError(
            f"Backend {chosen.backend.id} failed to load model {package.name!r} from {package.source}: "
            f"{framework_error(e)}"
        ) from e
    if handle is None:
        raise BackendError(f"Plugin {chosen.backend.plugin!r} did not load model {package.name!r}")
    return NeuropodModel(package, resolution, handle)


def _check_pipeline_pin(package: Package, backend: str | None) -> None:
    """A pipeline runs each step on its own backend: ``backend=`` may only name the pipeline itself."""
    if backend is not None and parse_backend_pin(backend)[0] != PIPELINE_PLATFORM:
        raise NoBackendError(
            f"backend={backend!r}: model {package.name!r} is a pipeline, whose steps each resolve their own backend; "
            "pin a step's backend with step_options={'<step>': {'backend': ...}}"
        )


def _load_pipeline(package: Package, sequences: Any, load_options: dict[str, Any], **args: Any) -> NeuropodModel:
    """:func:`load_neuropod` for a pipeline package: its steps, each loaded with ``args`` (and its ``step_options``)."""
    step_options = load_options.pop("step_options", None)
    if sequences is not None:
        raise ValueError(f"sequences=: model {package.name!r} is a pipeline; its stateful steps declare their own state")
    if load_options:
        raise ValueError(
            f"{', '.join(sorted(load_options))}: model {package.name!r} is a pipeline, whose steps may run on different "
            "backends; give a backend's load options to its step with step_options={'<step>': {...}}"
        )
    if step_options is not None and not isinstance(step_options, Mapping):
        raise TypeError(f"step_options must map step names to dicts of load_neuropod keywords, not {type(step_options).__name__}")
    resolution = plan(package, device=args["device"], backend=args.pop("backend"))
    assert isinstance(resolution, PipelinePlan)
    options = {k: args[k] for k in STEP_LOAD_ARGS}
    return load_pipeline(package, resolution, load_neuropod, step_options=step_options, options=options)


#: The keywords of :func:`load_neuropod` that say how to run the model (checked by :func:`check_load_args`).
LOAD_ARGS = ("device", "backend", "use_ope", "workers", "restart", "timeout")


def _original_load_options(options: dict[str, Any], device: str | None) -> str | None:
    """Take the original Neuropod's ``visible_gpu`` out of ``options``: the device it means.

    ``visible_gpu=None`` is the CPU. ``visible_gpu=N`` is ``device="cuda:N"``
    on a host that has that GPU; on one that does not, the original ran the
    model on the CPU (``visible_gpu=0`` was its default), so it means "no
    preference" there and resolution picks the device as usual.
    """
    if "visible_gpu" not in options:
        return device
    gpu = options.pop("visible_gpu")
    if device is not None:
        raise ValueError(f"give device= or visible_gpu= (the original Neuropod's form), not both (device={device!r}, visible_gpu={gpu!r})")
    if gpu is None:
        return "cpu"
    if isinstance(gpu, bool) or not isinstance(gpu, numbers.Integral) or gpu < 0:
        raise ValueError(f"visible_gpu must be a GPU index (an int >= 0) or None for the CPU, not {gpu!r:.60}")
    wanted = f"cuda:{int(gpu)}"
    return wanted if wanted in local_host().devices else None


def check_load_args(
    neuropod_path: object, *, device: object = None, backend: object = None, verify: object = True,
    use_ope: object = False, workers: object = 1, restart: object = False, timeout: object = None,
) -> None:  # fmt: skip
    """Check :func:`load_neuropod`'s arguments before any file is read (also for :func:`~neuropod.testdata.run_test_data`).

    :raises TypeError, ValueError: an argument of the wrong type or value.
    """
    _check_path("neuropod_path", neuropod_path, package_ok=True)
    _check_resolution_args(device, backend)
    for name, flag in (("verify", verify), ("use_ope", use_ope), ("restart", restart)):
        check_flag(name, flag)
    check_workers(workers)
    check_seconds("timeout", timeout)


def _load_in_workers(
    package: Package, resolution: Resolution, options: Mapping[str, Any], *, workers: int, restart: bool,
    timeout: float | None,
) -> NeuropodModel:  # fmt: skip
    chosen = resolution.raise_if_unresolved()
    backend = chosen.backend
    python = sys.executable
    lock = package.requirements_lock
    if lock is not None or backend.location.startswith("python:"):
        resolution, python = _lock_environment(package, resolution, lock or "")
        chosen = resolution.raise_if_unresolved()
        backend = chosen.backend
    elif backend.location.startswith("env:"):
        python = str(get_environment(backend.location[4:]).python)
    gpu_uuid = None
    if chosen.device and chosen.device.startswith("cuda"):
        gpu_uuid = resolution.host.gpu(chosen.device).uuid
    pool = start_pool(
        package.name, python, str(package.root), backend.id, chosen.device or "cpu", options_for_worker(options),
        workers=workers, restart=restart, timeout=timeout, gpu_uuid=gpu_uuid, package=package,
    )  # fmt: skip
    return WorkerModel(package, resolution, pool)


def _lock_environment(package: Package, resolution: Resolution, lock: str) -> tuple[Resolution, str]:
    """The lock environment for the package (built on first use), and the resolution with its backend.

    A package with ``0/requirements.lock``, or one whose backend is another
    interpreter (``python:<path>``), runs in a worker from an environment
    built from the lock (empty for the latter) on the chosen backend's
    interpreter. The model then reports that environment's backend.
    """
    chosen = resolution.raise_if_unresolved()
    env = lock_environment(lock, chosen.backend, package_name=package.name, package_source=str(package.source))
    found = [(b, c) for b, c in env.backends if b.platform == chosen.backend.platform]
    if not found:
        raise BackendError(
            f"The lock environment {env.name} ({env.path}) offers no {chosen.backend.platform!r} backend; "
            f"it offers: {', '.join(b.id for b, _ in env.backends) or 'none'}"
        )
    backend, caps = found[0]
    swapped = replace(chosen, backend=backend, caps=caps)
    candidates = tuple(swapped if c is chosen else c for c in resolution.candidates)
    return replace(resolution, candidates=candidates, chosen=swapped), str(env.python)


__all__ = ["LOAD_ARGS", "check_load_args", "load_neuropod", "plan", "with_sequences"]
