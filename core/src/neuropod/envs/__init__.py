"""Backend environments: other framework versions, each in its own Python environment.

One Python process can import only one onnxruntime (or torch, or TensorFlow).
A machine offers several versions of a framework by keeping each in its own
virtual environment under ``<NEUROPOD_HOME>/envs/<name>``, with the neuropod
core, the platform's plugin and the pinned framework installed. Resolution
treats the backends of every environment as candidates beside the in-process
ones (their ``Backend.location`` is ``"env:<name>"``); a model that only an
environment can run is loaded in a worker process started from that
environment's interpreter.

::

    neuropod env create onnx==1.20.1          # -> <home>/envs/onnx-1.20.1
    neuropod env create onnx==1.24.* --name ort124
    neuropod env list [--json]
    neuropod env remove onnx-1.20.1
    neuropod env prune --days 30              # lock environments unused for 30 days

Where: ``$NEUROPOD_HOME``, else ``$XDG_DATA_HOME/neuropod``, else
``~/.local/share/neuropod`` (see :func:`neuropod_home`).

Creation (:func:`create_environment`):

1. ``python -m venv`` (the running interpreter unless ``python=`` names
   another) into a hidden temporary directory ``<home>/envs/.tmp-<name>-*``;
2. ``<env python> -m pip install`` of the matching core, the plugin and the
   framework. "Matching" means: a core or
   plugin that was installed here from a local directory or wheel (pip's
   ``direct_url.json``; editable installs included) is installed from that same
   path, not editable; otherwise ``neuropod==<this version>`` and
   ``<plugin>==<its version>``, found through the user's pip configuration
   and ``--find-links`` (e.g. ``dist/`` from ``nox -s build``). The core is
   always pinned, so pip can never pick PyPI's unrelated ``neuropod`` 0.2;
3. ``<env python> -m neuropod backends --json``: the environment's own plugins
   say, through their hooks, which backends and devices it offers; that is
   recorded in ``<env>/neuropod-env.json`` with the spec, the creation time and
   the Python version;
4. the directory is renamed into place (atomic on one file system), and the
   scripts in its ``bin/`` that name the temporary path are rewritten.

A build reports one line per step with its time (``  installing 14 locked
requirements ... 38.0 s``) to ``out`` (stderr by default); ``verbose=True``
(``--verbose``) adds pip's own output. Any failure removes the temporary
directory and raises a
:class:`~neuropod.errors.NeuropodError` with the tail of pip's output. An
existing environment of the same name is an error unless ``replace=True``
(``--replace``), which swaps the new one in only once it is complete.

Lock environments (:func:`lock_environment`) are the other kind: a package
with ``0/requirements.lock`` (for example a ``python`` package with its
requirements) runs in a worker from an environment built from that lock,
the core and the package's plugin, named ``lock-py<X.Y>-<hash of the lock>``
and shared by every package with the same lock. They are built on first
load, rebuilt when the core changes, never
offered to resolution for other packages, and ``neuropod env prune`` removes
those no package used for N days (each load records its package in
``neuropod-users.json``).

Hidden entries (``.tmp-*`` being created, ``.trash-*`` being removed,
``.locks/`` for building) are not environments. A directory without a
readable ``neuropod-env.json`` or whose
interpreter is gone is listed with a ``problem`` and offers no backends.
"""

from neuropod.envs.builder import (
    FRAMEWORK_DISTRIBUTIONS,
    create_environment,
    install_requirements,
    parse_spec,
    remove_environment,
)
from neuropod.envs.locks import LOCK_PREFIX as LOCK_PREFIX
from neuropod.envs.locks import lock_environment, lock_environment_name, lock_lines, prune_environments
from neuropod.envs.records import (
    ENV_FILE,
    Environment,
    core_fingerprint,
    environment_backends,
    environment_of,
    get_environment,
    list_environments,
    neuropod_home,
)
from neuropod.envs.records import FORMAT_VERSION as FORMAT_VERSION
from neuropod.envs.records import LOCATION_PREFIX as LOCATION_PREFIX
from neuropod.envs.records import USERS_FILE as USERS_FILE
from neuropod.envs.records import envs_dir as envs_dir

__all__ = [
    "ENV_FILE",
    "FRAMEWORK_DISTRIBUTIONS",
    "Environment",
    "core_fingerprint",
    "create_environment",
    "environment_backends",
    "environment_of",
    "get_environment",
    "install_requirements",
    "list_environments",
    "lock_environment",
    "lock_environment_name",
    "lock_lines",
    "neuropod_home",
    "parse_spec",
    "prune_environments",
    "remove_environment",
]
