"""Every test, lint, type, benchmark and build session.

    nox -t ci                      what CI runs (README's test command)
    nox -s tests_core              core tests on Python 3.10 to 3.13
    nox -s tests_onnx              the ONNX plugin on onnxruntime 1.31.1, 1.24.4 and 1.20.1
    nox -s tests_storage           packages by URL: S3 (moto's server), GCS and Azure emulators, a local web server;
                                   neuropod serve of a model repository in a bucket, polled
    nox -s tests_envs              two real backend environments (onnxruntime 1.20.1, 1.24.4) beside 1.31.1
    nox -s tests_torchscript       the TorchScript plugin on torch 2.13.0 and 2.14.1
    nox -s tests_torch             the torch.export / AOTInductor plugin on torch 2.13.0
    nox -s tests_jax               the JAX plugin on jax 0.10.2, 0.9.2 and 0.8.3
    nox -s tests_tensorflow        the TensorFlow plugin on tensorflow-cpu 2.21.0, 2.18.1 and 2.16.2
    nox -s tests_compat            code written for the original Neuropod (tests/compat), ONNX + torch + TensorFlow
    nox -s tests_compare           neuropod compare on one model as ONNX, torch.export, TorchScript, JAX and TensorFlow;
                                   its HTML report in headless Chromium (Playwright; installs Debian's chromium)
    nox -s tests_python            the Python backend: isolation, lock environments (scikit-learn, torch), other Pythons
    nox -s tests_tensorrt          the TensorRT plugin (GPU tests skip without a GPU and TensorRT)
    nox -s tests_gpu               on a GPU machine: core, ONNX (onnxruntime-gpu), TorchScript (CUDA torch), Python,
                                   TensorRT and tests/gpu, GPU tests required (not CI; offline: tests/gpu/offline.sh)
    nox -s bench_gpu               on a GPU machine: bench/bench_gpu.py
    nox -s tests_serving           neuropod-serving: `neuropod serve` (REST, gRPC, batching, metrics) with tritonclient,
                                   remote models against it and against MLServer
    nox -s tests_client_only       a remote model loaded from a venv with only neuropod + neuropod-serving[client]
    nox -s tests_ray               neuropod_serving.ray on local Ray clusters: replicas, two nodes, a killed replica,
                                   autoscaling, neuropod serve's errors, serve run / --ray; tritonclient (~4 min)
    nox -s lint types              ruff, mypy
    nox -s imports                 the import graph read from source (tests/test_import_graph.py): no circles, own
                                   imports inside functions only with a `# lazy:` reason, no file over 600 lines;
                                   `neuropod serve --help` imports no server library; import-linter's contracts
    nox -s docs                    every code block of docs/ and the READMEs run, the site built (warnings are errors)
    nox -s bench                   benchmarks (print ratios against the raw framework)
    nox -s charts                  docs/performance.md's charts: quick benches with --json, then bench/charts.py
                                   (-- --from-data: only redraw from docs/_static/perf/data/)
    nox -s bench_serve             neuropod serve against MLServer and a bare floor (REST + gRPC, ~12 min)
    nox -s bench_remote            remote models' latency against in-process, tritonclient and the transport floor
    nox -s bench_stream            streams (gRPC ModelStreamInfer, SSE) against a bare grpcio / Starlette floor: per
                                   response, time to the first response, memory of 100 open streams (~1 min)
    nox -s bench_sequences         stateful models: a sequence step's added cost, 32 GRU sequences batched against
                                   unbatched (in process and through neuropod serve; ~2 min)
    nox -s bench_pipelines         pipelines: a three-step pipeline's added cost over its models by hand, in process;
                                   served, one pipeline request against three client round trips (~1 min)
    nox -s bench_storage           packages by URL from local S3 servers against local disk (cold, cached, memory)
    nox -s bench_ray               the Ray Serve deployment (1, 2 replicas, Ray's floor) against neuropod serve (~4 min)
    nox -s build                   wheels for the core, every plugin and neuropod-serving into dist/
    nox -s wheels                  the same wheels, installed alone into a fresh venv and smoke-tested
    nox -s tests_example           the outside backend in examples/ against the conformance suite

Plugins are discovered from ``plugins/``; each is installed next to the core
from source, never from PyPI (PyPI's old ``neuropod`` 0.2 is another project).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox
from packaging.version import Version

ROOT = Path(__file__).parent
CORE = ROOT / "core"
PLUGINS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())
SERVING = ROOT / "serving"
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
DEFAULT_PYTHON = "3.11"

# onnxruntime releases the ONNX plugin is tested against; the first is the
# one benchmarks use.
ONNXRUNTIME_VERSIONS = ["1.31.1", "1.24.4", "1.20.1"]
ONNXRUNTIME_DEFAULT = ONNXRUNTIME_VERSIONS[0]



def _find_pythons() -> None:
    """Put pyenv's interpreters on PATH when ``python3.X`` is not there (pyenv
    shims only answer for the active version), so every listed Python runs."""
    import glob

    missing = []
    for version in PYTHONS:
        exe = shutil.which(f"python{version}")
        ok = exe is not None and subprocess.run([exe, "--version"], capture_output=True).returncode == 0
        if not ok:
            missing.append(version)
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    dirs = [sorted(glob.glob(f"{root}/versions/{v}.*/bin"))[-1:] for v in missing]
    extra = [d[0] for d in dirs if d]
    if extra:
        os.environ["PATH"] = os.pathsep.join([*extra, os.environ.get("PATH", "")])


_find_pythons()

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    # A private package cache, NEUROPOD_HOME (backend environments) and
    # XDG_CACHE_HOME per run, removed afterwards: tests leave nothing behind and
    # see none of the user's. (onnxruntime, for one, writes under
    # $XDG_CACHE_HOME/Microsoft at import; HOME itself stays, for pip's config.)
    with tempfile.TemporaryDirectory(prefix="neuropod-cache-") as cache, \
            tempfile.TemporaryDirectory(prefix="neuropod-home-") as home, \
            tempfile.TemporaryDirectory(prefix="neuropod-xdg-cache-") as xdg_cache:  # fmt: skip
        session.run(
            "python", "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *paths, *session.posargs,
            env={"NEUROPOD_CACHE_DIR": cache, "NEUROPOD_HOME": home, "XDG_CACHE_HOME": xdg_cache, **(env or {})},
        )


@nox.session(python=PYTHONS, tags=["ci"])
def tests_core(session: nox.Session) -> None:
    """The core's tests, with no backend framework installed."""
    session.install(f"{CORE}[test]")
    _pytest(session, "core/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 1 min
def tests_storage(session: nox.Session) -> None:
    """Packages loaded by URL (neuropod.storage, the core's s3 and http extras): moto's S3 server
    on 127.0.0.1 driven through s3fs, and a local web server, with the ONNX demo model."""
    # gcp-storage-emulator: a GCS server in Python, for gs:// through gcsfs.
    # onnx: the query-key tests build two models of one size with onnx.helper.
    session.install(f"{CORE}[test,s3,http,gcs,azure]", str(ROOT / "plugins/neuropod-onnx"), f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx",
                    f"{SERVING}[server]", str(ROOT / "plugins/neuropod-python"), "httpx>=0.27",
                    "gcp-storage-emulator==2026.7.19")  # fmt: skip
    # moto brings boto3, which must take the botocore that s3fs's aiobotocore pinned.
    botocore = session.run("python", "-c", "import botocore; print(botocore.__version__)", silent=True)
    session.install("moto[server]>=5", f"botocore=={str(botocore).strip()}")
    env = {"NO_GCE_CHECK": "true"}  # not on Google Cloud: no metadata server to probe
    # Azurite, Microsoft's Azure Storage emulator, from npm (3.35: the last that runs on Node.js 20),
    # for az:// through adlfs. Without npm its tests skip, saying so.
    azurite = Path(session.virtualenv.location) / "azurite"
    blob = azurite / "node_modules" / ".bin" / "azurite-blob"
    if shutil.which("npm") is None:
        session.warn("npm is not installed: the az:// tests against Azurite skip")
    else:
        if not blob.exists():
            session.run("npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(azurite),
                        "azurite@3.35.0", external=True)  # fmt: skip
        env["NEUROPOD_TEST_AZURITE"] = str(blob)
    _pytest(session, "core/tests/test_storage.py", "core/tests/test_storage_urls.py", "core/tests/test_storage_gcs.py",
            "core/tests/test_storage_azure.py", "core/tests/test_storage_downloads_identity.py",
            "core/tests/test_storage_secrets.py", "core/tests/test_download_partials.py",
            "core/tests/test_storage_stores_identity.py", env=env)  # fmt: skip
    # A model repository in a bucket, served and polled (neuropod serve s3://...).
    _pytest(session, "serving/tests/test_versions_s3.py", "serving/tests/test_serve_url_secrets.py")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
@nox.parametrize("onnxruntime", ONNXRUNTIME_VERSIONS)
def tests_onnx(session: nox.Session, onnxruntime: str) -> None:
    """The ONNX plugin against one onnxruntime release (all three run in CI: they are small)."""
    _install_onnx(session, onnxruntime)
    # Stateful models on ONNX, in process and in workers (a worker killed mid-step: a python model sleeps).
    session.install(str(ROOT / "plugins/neuropod-python"))
    _pytest(session, "plugins/neuropod-onnx/tests", "core/tests/test_sequences.py", "core/tests/test_ope_sequences.py")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_envs(session: nox.Session) -> None:
    """Two real backend environments (onnxruntime 1.20.1 and 1.24.4) beside this session's 1.31.1:
    creation, listing, resolution between them, both models running at once, and `neuropod compare` of one package
    under the three releases (downloads ~30 MB);
    then a jax 0.9.2 environment beside jax 0.10.2, each running the other's packages; then AOTInductor
    packages compiled by torch 2.13.0 and 2.14.1, each run from the other release through an environment; then a
    pipeline whose TensorFlow step runs in a tensorflow 2.18.1 environment and feeds an ONNX step in this session."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]", f"onnxruntime=={ONNXRUNTIME_DEFAULT}")
    # neuropod compare of one package under this onnxruntime and the environments' (in the same run: the same two).
    _pytest(session, "plugins/neuropod-onnx/tests/test_environments.py",
            "plugins/neuropod-onnx/tests/test_compare_environments.py", env={"NEUROPOD_TEST_ENVS": "1"})  # fmt: skip
    # A jax backend environment beside this session's jax (about 20 s more).
    session.install(f"{ROOT / 'plugins/neuropod-jax'}[test]", f"jax=={JAX_DEFAULT}", f"jaxlib=={JAX_DEFAULT}")
    _pytest(session, "plugins/neuropod-jax/tests/test_environments.py", env={"NEUROPOD_TEST_ENVS": "1"})
    # AOTInductor across torch releases: aoti==2.13.0 and aoti==2.14.1 environments, a package compiled by each
    # run from the other (2.14.1 is a CUDA build of about 5 GB; about 2 min).
    session.install(f"{ROOT / 'plugins/neuropod-torch'}[test]", f"torch=={TORCH_DEFAULT}")
    _pytest(session, "plugins/neuropod-torch/tests/test_environments.py", env={"NEUROPOD_TEST_ENVS": "1"})
    # A pipeline: a TensorFlow step pinned to ~2.18, run in a tensorflow==2.18.1 environment (~250 MB downloaded; this
    # session has the plugin but no TensorFlow), then an ONNX step here, value-exact against each step by hand (~1 min).
    session.install(f"{ROOT / 'plugins/neuropod-tensorflow'}[test]")
    _pytest(session, "plugins/neuropod-tensorflow/tests/test_pipeline_envs.py", env={"NEUROPOD_TEST_ENVS": "1"})


# torch releases the TorchScript plugin is tested against. 2.13.0 (a CPU
# build) is the default and the one CI runs; 2.14.1 is a CUDA build of
# several GB (CPU-tested here), run by `nox -s tests_torchscript`.
TORCH_VERSIONS = [nox.param("2.13.0", tags=["ci"]), "2.14.1"]
TORCH_DEFAULT = "2.13.0"


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize("torch", TORCH_VERSIONS)
def tests_torchscript(session: nox.Session, torch: str) -> None:
    """The TorchScript plugin against one torch release (needs g++ for the custom-op test)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-torchscript'}[test]", f"torch=={torch}")
    _pytest(session, "plugins/neuropod-torchscript/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_torch(session: nox.Session) -> None:
    """The torch.export and AOTInductor plugin (neuropod-torch) on torch 2.13.0, its packages served by
    `neuropod serve` too (needs g++: AOTInductor compiles C++; the suite compiles few packages); with the JAX
    plugin and jax beside it for a pipeline of a torch.export step feeding a JAX step (about 100 MB more)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-torch'}[test]", f"torch=={TORCH_DEFAULT}",
                    f"{SERVING}[server]", str(ROOT / "plugins/neuropod-jax"), f"jax=={JAX_DEFAULT}",
                    f"jaxlib=={JAX_DEFAULT}")  # fmt: skip
    _pytest(session, "plugins/neuropod-torch/tests")


# JAX releases the JAX plugin is tested against (CPU wheels); the first is the default.
JAX_VERSIONS = ["0.10.2", "0.9.2", "0.8.3"]
JAX_DEFAULT = JAX_VERSIONS[0]


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
@nox.parametrize("jax", JAX_VERSIONS)
def tests_jax(session: nox.Session, jax: str) -> None:
    """The JAX plugin (neuropod-jax) against one jax/jaxlib release, its packages served by `neuropod serve` too."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-jax'}[test]", f"jax=={jax}", f"jaxlib=={jax}",
                    f"{SERVING}[server]")  # fmt: skip
    _pytest(session, "plugins/neuropod-jax/tests")


# TensorFlow releases the TensorFlow plugin is tested against, as
# tensorflow-cpu; the newest is the default and the one CI runs.
TENSORFLOW_VERSIONS = [nox.param("2.21.0", tags=["ci"]), "2.18.1", "2.16.2"]
TENSORFLOW_DEFAULT = "2.21.0"


@nox.session(python=DEFAULT_PYTHON)
@nox.parametrize("tensorflow", TENSORFLOW_VERSIONS)
def tests_tensorflow(session: nox.Session, tensorflow: str) -> None:
    """The TensorFlow plugin against one tensorflow-cpu release (needs g++ for the custom-op test)."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-tensorflow'}[test]", f"tensorflow-cpu=={tensorflow}")
    _pytest(session, "plugins/neuropod-tensorflow/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 4 min, most of it building lock environments
def tests_python(session: nox.Session) -> None:
    """The Python backend (neuropod-python): conformance, isolation, errors, and lock environments
    built for real (scikit-learn, torch) in the session's NEUROPOD_HOME. The session has no
    scikit-learn: its packages run in their own environments."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-python'}[test]", f"torch=={TORCH_DEFAULT}")
    _pytest(session, "plugins/neuropod-python/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_compat(session: nox.Session) -> None:
    """tests/compat: code written for the original Neuropod (0.3) against ours, with the ONNX,
    TorchScript and TensorFlow plugins and the default framework releases; one pytest process per
    module, so torch and TensorFlow never share one."""
    session.install(
        f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]", f"onnxruntime=={ONNXRUNTIME_DEFAULT}",
        f"{ROOT / 'plugins/neuropod-torchscript'}[test]", f"torch=={TORCH_DEFAULT}",
        f"{ROOT / 'plugins/neuropod-tensorflow'}[test]", f"tensorflow-cpu=={TENSORFLOW_DEFAULT}",
    )
    for module in sorted((ROOT / "tests" / "compat").glob("test_compat_*.py")):
        _pytest(session, str(module.relative_to(ROOT)))


# Playwright drives a Chromium it does not download: Debian's, at this path.
PLAYWRIGHT = "1.65.2"
CHROMIUM = "/usr/bin/chromium"


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_compare(session: nox.Session) -> None:
    """tests/compare: `neuropod compare` on one model packaged as ONNX, torch.export, TorchScript, JAX and
    TensorFlow (each built in a process of its own), a changed weight caught; the HTML report opened in
    headless Chromium through Playwright (no request but the file, no console error), a screenshot taken
    (NEUROPOD_UPDATE_SCREENSHOT=1 writes docs/_static/compare/report.png). Installs Debian's chromium package
    with apt-get when /usr/bin/chromium is missing and the session runs as root (otherwise the browser test
    skips, saying why); Playwright's own browser downloads are never used."""
    session.install(
        f"{CORE}[test]", str(ROOT / "plugins/neuropod-onnx"), "onnx", f"onnxruntime=={ONNXRUNTIME_DEFAULT}",
        str(ROOT / "plugins/neuropod-torch"), str(ROOT / "plugins/neuropod-torchscript"), f"torch=={TORCH_DEFAULT}",
        str(ROOT / "plugins/neuropod-jax"), f"jax=={JAX_DEFAULT}", f"jaxlib=={JAX_DEFAULT}",
        str(ROOT / "plugins/neuropod-tensorflow"), f"tensorflow-cpu=={TENSORFLOW_DEFAULT}", f"playwright=={PLAYWRIGHT}",
        "pillow",  # NEUROPOD_UPDATE_SCREENSHOT=1: the docs' screenshot, in 256 colours
    )  # fmt: skip
    if not os.access(CHROMIUM, os.X_OK):
        if shutil.which("apt-get") and os.geteuid() == 0:
            install = "apt-get install -y --no-install-recommends chromium"
            session.run("bash", "-c", f"{install} || (apt-get update && {install})", external=True,
                        env={"DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        else:
            session.warn(f"no {CHROMIUM} and no apt-get as root to install it: the browser test skips")
    _pytest(session, "tests/compare")


# The GPU builds tests_gpu and bench_gpu install: torch's PyPI wheels for Linux x86-64 are CUDA
# builds; onnxruntime-gpu 1.31 links CUDA 13.
TORCH_GPU = "2.14.1"
ONNXRUNTIME_GPU = "1.31.1"
_NEEDS_A_GPU = (
    "import sys, neuropod.devices as d; h = d.read_nvml(); print(h.describe()); "
    "sys.exit(0 if h.has_gpu else 'this session needs an NVIDIA GPU and its driver: ' + str(h.note))"
)


def _install_gpu(session: nox.Session) -> None:
    session.install(
        f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test,gpu]", f"onnxruntime-gpu[cuda,cudnn]=={ONNXRUNTIME_GPU}",
        f"{ROOT / 'plugins/neuropod-torchscript'}[test]", f"torch=={TORCH_GPU}",
        f"{ROOT / 'plugins/neuropod-python'}[test]", f"{ROOT / 'plugins/neuropod-tensorrt'}[test]",
        f"{ROOT / 'plugins/neuropod-torch'}[test]", f"{ROOT / 'plugins/neuropod-jax'}[test]",
        f"jax[cuda13]=={JAX_DEFAULT}", f"{ROOT / 'serving'}[server,test]",
    )  # fmt: skip
    session.run("python", "-c", _NEEDS_A_GPU)


@nox.session(python=DEFAULT_PYTHON)
def tests_gpu(session: nox.Session) -> None:
    """On a machine with an NVIDIA GPU (driver for CUDA 13): the core, ONNX (onnxruntime-gpu), TorchScript and
    torch.export/AOTInductor (torch's CUDA build), JAX (jax[cuda13]), Python and TensorRT suites, tests/gpu and the server's GPU tests, with NEUROPOD_REQUIRE_GPU=1, so a GPU
    test that cannot run fails rather than skips (TensorRT's engine tests still skip: its libraries come
    from NVIDIA's index). Not in CI, which has no GPU. Offline GPU machines: tests/gpu/offline.sh."""
    _install_gpu(session)
    env = {"NEUROPOD_REQUIRE_GPU": "1"}
    for suite in ("tests/gpu", "core/tests", "plugins/neuropod-onnx/tests", "plugins/neuropod-torchscript/tests",
                  "plugins/neuropod-torch/tests", "plugins/neuropod-jax/tests", "plugins/neuropod-python/tests",
                  "plugins/neuropod-tensorrt/tests"):  # fmt: skip
        _pytest(session, suite, env=env)
    # The server's GPU tests (CUDA shared memory, GPU instance groups); the rest of its suite needs no GPU.
    _pytest(session, "serving/tests", "-m", "gpu", env=env)


@nox.session(python=DEFAULT_PYTHON)
def bench_gpu(session: nox.Session) -> None:
    """bench/bench_gpu.py on a GPU machine: neuropod against torch and onnxruntime-gpu called directly."""
    _install_gpu(session)
    session.run("python", "bench/bench_gpu.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_tensorrt(session: nox.Session) -> None:
    """The TensorRT plugin without TensorRT: planning and packaging tests run, GPU tests skip with the reason."""
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-tensorrt'}[test]")
    _pytest(session, "plugins/neuropod-tensorrt/tests")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_serving(session: nox.Session) -> None:
    """neuropod-serving: the Open Inference Protocol codecs and `neuropod serve` (REST and gRPC,
    batching, metrics, repository, TLS) with real ONNX packages, driven by the official
    tritonclient over HTTP and gRPC; and remote models against MLServer 1.7 serving scikit-learn
    models with its own runtime (MLServer from its own venv in this session's folder)."""
    session.install(
        f"{CORE}[test,http]", f"{SERVING}[server,test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]",
        f"onnxruntime=={ONNXRUNTIME_DEFAULT}", str(ROOT / "plugins/neuropod-python"),
        "pillow",  # the image decoding step of ensemble_image_client.py's model
    )  # fmt: skip
    mlserver = _mlserver_venv(session, "mlserver-sklearn==1.7.1", "scikit-learn==1.9.1")
    _pytest(session, "serving/tests", env={"NEUROPOD_TEST_MLSERVER_PYTHON": str(mlserver / "bin" / "python")})


def _mlserver_venv(session: nox.Session, *packages: str) -> Path:
    """MLServer 1.7.1 and ``packages`` in a venv of their own in the session's folder, made once and
    reused: MLServer pins its own dependencies, so it cannot share the session's venv. Its default
    parallel workers break under uvloop 0.22+ (SeldonIO/MLServer#2286), hence ``uvloop<0.22``."""
    venv = Path(session.virtualenv.location) / "mlserver-venv"
    if not (venv / "bin" / "python").exists():
        session.run("python", "-m", "venv", str(venv))
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "mlserver==1.7.1", "uvloop<0.22",
                *packages, external=True)  # fmt: skip
    return venv


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 1 min
def tests_client_only(session: nox.Session) -> None:
    """A remote model from a venv holding only neuropod and neuropod-serving[client] (no framework,
    no server library): `neuropod serve` runs the demo model from this session's venv, and the
    client venv loads it by grpc:// and http:// URL (serving/tests/remote_client_only.py)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="neuropod-client-only-"))
    client = work / "client-venv"
    session.run("python", "-m", "venv", str(client))
    py = str(client / ("Scripts" if os.name == "nt" else "bin") / "python")
    session.run(py, "-m", "pip", "install", "--quiet", str(CORE), f"{SERVING}[client]", external=True)
    env = {"NEUROPOD_CACHE_DIR": str(work / "cache")}
    session.run("neuropod", "demo", "--dir", str(work / "models"), silent=True, env=env)
    ports = _free_ports(2)
    server = subprocess.Popen(
        [str(Path(session.bin) / "neuropod"), "serve", str(work / "models"), "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", "0", "--quiet"],
        env={**os.environ, **env},
    )  # fmt: skip
    try:
        _wait_for_port(ports[1], server, 60)
        _wait_for_port(ports[0], server, 60)
        session.run(py, str(SERVING / "tests" / "remote_client_only.py"),
                    f"grpc://127.0.0.1:{ports[1]}/demo_adder", f"http://127.0.0.1:{ports[0]}/demo_adder",
                    external=True)  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 4 min, most of it installing Ray
def tests_ray(session: nox.Session) -> None:
    """neuropod_serving.ray on local Ray clusters (serving/tests/ray_serve: two replicas driven by
    tritonclient and remote models, a simulated two-node cluster, a replica killed mid-stream,
    autoscaling, the errors of `neuropod serve`, per-replica metrics, a decoupled model streamed through a
    streaming handle and both proxies; serving/tests/ray_config:
    `serve run` with the example config and `neuropod serve --ray`, each starting its own cluster,
    so each in its own pytest process). tritonclient pins protobuf < 7 and Ray needs 7: it runs
    from a venv of its own in this session's folder."""
    # Ray pinned to the release tested. Not tritonclient: it would pull protobuf < 7. neuropod-python runs
    # the streaming tests' decoupled model.
    session.install(f"{CORE}[test]", f"{SERVING}[ray]", "ray[serve]==2.60.0", f"{ROOT / 'plugins/neuropod-onnx'}",
                    "onnx", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", f"{ROOT / 'plugins/neuropod-python'}")  # fmt: skip
    triton = Path(session.virtualenv.location) / "triton-venv"
    if not (triton / "bin" / "python").exists():
        session.run("python", "-m", "venv", str(triton))
    session.run(str(triton / "bin" / "python"), "-m", "pip", "install", "--quiet", "tritonclient[http,grpc]>=2.40",
                "numpy", external=True)  # fmt: skip
    env = {"NEUROPOD_TEST_TRITON_PYTHON": str(triton / "bin" / "python")}
    _pytest(session, "serving/tests/ray_serve", env=env)  # one cluster per module, shut down between them
    for module in sorted((SERVING / "tests" / "ray_config").glob("test_*.py")):
        _pytest(session, str(module.relative_to(ROOT)), env=env)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], seconds: float) -> None:
    import socket
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"neuropod serve exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"neuropod serve did not open port {port} within {seconds:g} s")


def _install_onnx(session: nox.Session, onnxruntime: str) -> None:
    # onnxruntime-extensions ships the custom-op library the tests register;
    # its newest releases follow onnxruntime, so older runtimes get an older one.
    extensions = "onnxruntime-extensions" if Version(onnxruntime) >= Version("1.24") else "onnxruntime-extensions<0.14"
    session.install(f"{CORE}[test]", f"{ROOT / 'plugins/neuropod-onnx'}[test]", f"onnxruntime=={onnxruntime}", extensions)


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff==0.17.6")  # pinned: a new rule must not break CI overnight
    session.run("ruff", "check", ".")


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def types(session: nox.Session) -> None:
    """mypy (strict) over the core, the plugins and neuropod-serving."""
    # pytest too: neuropod.testing is a pytest plugin, typed against pytest.
    session.install("mypy==2.4.1", f"{CORE}[test]", *[str(p) for p in PLUGINS], f"{SERVING}[server]",
                    f"torch=={TORCH_DEFAULT}", f"jax=={JAX_DEFAULT}", f"jaxlib=={JAX_DEFAULT}")  # fmt: skip
    session.run("mypy", "core/src/neuropod", *[str(next((p / "src").iterdir())) for p in PLUGINS],
                "serving/src/neuropod_serving")  # fmt: skip


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # under a minute
def imports(session: nox.Session) -> None:
    """The import graph of the core, neuropod-serving and the plugins, read from source: no import circle,
    an own-module import inside a function only with a `# lazy:` reason, no library file over 600 lines
    unless allowed by name; and `neuropod serve --help` (core and serving installed, as users get them)
    imports no server library. Then import-linter's contracts (.importlinter): the core imports neither
    serving nor a plugin, plugins never import one another nor serving, no package's parts import one
    another round, and the core, neuropod-serving, its server and its protocol codec each read top-down
    in the layers listed there."""
    session.install("pytest>=8", "import-linter==2.17", str(CORE), f"{SERVING}[server]")
    _pytest(session, "tests/test_import_graph.py")
    # import-linter's contracts (.importlinter), read from the checkout's sources: plugins need not be installed.
    sources = [CORE / "src", SERVING / "src", *[p / "src" for p in PLUGINS]]
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": os.pathsep.join(map(str, sources))})


# --- documentation ----------------------------------------------------------

DOCS_TOOLS = ["sphinx==9.0.4", "myst-parser==5.2.0", "furo==2025.12.19", "sybil==10.1.0"]


def _markdown_files() -> list[str]:
    """The site's pages and every README: each is a Sybil document."""
    pages = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    readmes = [ROOT / "README.md", CORE / "README.md", *(p / "README.md" for p in PLUGINS), SERVING / "README.md",
               EXAMPLE / "README.md"]  # fmt: skip
    return [str(p.relative_to(ROOT)) for p in [*pages, *readmes] if p.is_file()]


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 5 min: installing the frameworks, then every page
def docs(session: nox.Session) -> None:
    """The documentation: every code block of docs/ and the READMEs run (Sybil; one pytest process
    per page, as torch and TensorFlow must not share one), the reference meta-tests, then the site
    built with every warning (a broken link or anchor, a missing page) an error, into build/docs.
    ``nox -s docs -- PAGE.md ...`` runs those pages only; ``-- --linkcheck`` also checks external links
    (needs the network)."""
    session.install(
        *DOCS_TOOLS, f"{CORE}[test,http]", *[f"{p}" for p in PLUGINS], f"{SERVING}[server,client]",
        f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", f"torch=={TORCH_DEFAULT}", f"jax=={JAX_DEFAULT}",
        f"jaxlib=={JAX_DEFAULT}", f"tensorflow-cpu=={TENSORFLOW_DEFAULT}", "tritonclient[http,grpc]>=2.73",
        "grpcio-health-checking",  # the health client stub of serving.md's probe example
        f"{EXAMPLE}",  # the outside backend, whose README runs too
    )  # fmt: skip
    linkcheck = "--linkcheck" in session.posargs
    pages = [a for a in session.posargs if a.endswith(".md")] or _markdown_files()
    failed = []
    with tempfile.TemporaryDirectory(prefix="neuropod-docs-home-") as home:
        env = {"NEUROPOD_CACHE_DIR": f"{home}/cache", "NEUROPOD_HOME": f"{home}/home", "XDG_CACHE_HOME": f"{home}/xdg"}
        for page in pages:
            try:
                session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--no-header", page,
                            env=env, success_codes=[0, 5])  # fmt: skip  (5: a page with no code block)
            except nox.command.CommandFailed:
                failed.append(page)
    if not [a for a in session.posargs if a.endswith(".md")]:
        _pytest(session, "docs/tests")
        out = ROOT / "build" / "docs"
        shutil.rmtree(out, ignore_errors=True)
        session.run("sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out / "html"))
        if linkcheck:
            session.run("sphinx-build", "-q", "-b", "linkcheck", "docs", str(out / "linkcheck"))
        session.log(f"the site: {out / 'html' / 'index.html'}")
    if failed:
        session.error(f"examples failed on {len(failed)} page(s): {', '.join(failed)}")


@nox.session(python=DEFAULT_PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks: our call against the raw framework call, same run."""
    session.install(
        f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx",
        f"{ROOT / 'plugins/neuropod-torchscript'}", f"torch=={TORCH_DEFAULT}",
        f"{ROOT / 'plugins/neuropod-tensorflow'}", f"tensorflow-cpu=={TENSORFLOW_DEFAULT}",
        f"{ROOT / 'plugins/neuropod-python'}",
        f"{ROOT / 'plugins/neuropod-torch'}", f"{ROOT / 'plugins/neuropod-jax'}", f"jax=={JAX_DEFAULT}",
        f"jaxlib=={JAX_DEFAULT}",
    )
    for script in sorted((ROOT / "bench").glob("bench_*.py")):
        if script.name not in ("bench_serve.py", "bench_remote.py", "bench_ray.py", "bench_gpu.py", "bench_stream.py",
                               "bench_sequences.py", "bench_pipelines.py"):  # their own sessions
            session.run("python", str(script), *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_serve(session: nox.Session) -> None:
    """neuropod serve against MLServer 1.7, LitServe and a bare Starlette/grpcio floor, REST and gRPC, and
    --processes 1 and 2 against the floor forked as many times (about 20 min; needs wrk and taskset, two
    cores). MLServer and LitServe run from venvs of their own (_mlserver_venv, _litserve_venv)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx")  # fmt: skip
    mlserver = _mlserver_venv(session, f"onnxruntime=={ONNXRUNTIME_DEFAULT}")
    litserve = _litserve_venv(session, f"onnxruntime=={ONNXRUNTIME_DEFAULT}")
    session.run("python", "bench/bench_serve.py", "--mlserver-venv", str(mlserver), "--litserve-venv", str(litserve),
                *session.posargs)  # fmt: skip


#: LitServe for bench_serve: the release measured (its API moves between minor releases).
LITSERVE = "litserve==0.2.19"


def _litserve_venv(session: nox.Session, *packages: str) -> Path:
    """LitServe and ``packages`` in a venv of their own in the session's folder (it pins FastAPI and
    uvicorn releases of its own), made once and reused."""
    venv = Path(session.virtualenv.location) / "litserve-venv"
    if not (venv / "bin" / "python").exists():
        session.run("python", "-m", "venv", str(venv))
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", LITSERVE, *packages, external=True)
    return venv


@nox.session(python=DEFAULT_PYTHON)
def bench_perf_analyzer(session: nox.Session) -> None:
    """Triton's perf_analyzer against neuropod serve (HTTP, gRPC, system shared memory) beside
    bench_serve.py's own load generators on the same cells (about 3 min; wrk, taskset, two cores;
    perf_analyzer from --perf-analyzer, ../shared/tools/perf-analyzer or PATH)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", "tritonclient[grpc,http]")  # fmt: skip
    session.run("python", "bench/bench_perf_analyzer.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def triton_examples(session: nox.Session) -> None:
    """Triton's own Python client examples, unchanged, against neuropod serve: one run per example and
    protocol, PASS/FAIL/SKIP (about 1 min; not part of CI). Give the examples' checkout:
    nox -s triton_examples -- --examples /path/to/triton-inference-server/client"""
    # neuropod-python: repeat_int32, the decoupled model of simple_grpc_custom_repeat.py.
    # pillow and attrdict: image_client.py's imports (attrdict for its HTTP variant).
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{ROOT / 'plugins/neuropod-python'}",
                    f"{SERVING}[server]", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx",
                    "tritonclient[http,grpc]>=2.73", "pillow", "attrdict")  # fmt: skip
    session.run("python", "bench/triton_examples.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_shm(session: nox.Session) -> None:
    """System shared memory against binary tensors in the message for a 6.9 MB image, REST and
    gRPC, with tritonclient, next to the model's own run (about 1 min)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", "tritonclient[grpc,http]")  # fmt: skip
    session.run("python", "bench/bench_shm.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_remote(session: nox.Session) -> None:
    """A remote model's infer (gRPC and REST) against the same model in-process, tritonclient and
    the bare grpcio / Starlette floors, sequential calls (about 7 min; taskset, two cores)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", "tritonclient[grpc,http]")  # fmt: skip
    session.run("python", "bench/bench_remote.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_stream(session: nox.Session) -> None:
    """Streams from neuropod serve (a decoupled Python-backend model, gRPC ModelStreamInfer and SSE
    infer_stream) against a bare grpcio stream and a bare Starlette SSE endpoint: per-response cost
    of 1,000-response streams, time to the first response against a unary call, memory of 100 open
    streams (about 1 min; taskset, two cores)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-python'}", f"{SERVING}[server]", "httpx")
    session.run("python", "bench/bench_stream.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_sequences(session: nox.Session) -> None:
    """Stateful models: what a sequence step adds to a tiny ONNX model's call (against its stateless
    twin given the state by hand), and 32 sequences of a GRU step model (torch.export, hidden 512)
    batched against unbatched, in process (infer_sequences) and through neuropod serve driven by 32
    tritonclient sequences over gRPC and REST (about 3 min; taskset, two cores)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{ROOT / 'plugins/neuropod-torch'}",
                    f"{SERVING}[server]", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", f"torch=={TORCH_DEFAULT}",
                    "tritonclient[grpc,http]>=2.73")  # fmt: skip
    session.run("python", "bench/bench_sequences.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_pipelines(session: nox.Session) -> None:
    """Pipelines: what a three-step pipeline of tiny ONNX models adds over calling its models by hand
    (and raw onnxruntime sessions), in process; served, one pipeline request against three client
    round trips, tritonclient over gRPC and REST (about 1 min; taskset, two cores)."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[server]",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx", "tritonclient[grpc,http]>=2.73")  # fmt: skip
    session.run("python", "bench/bench_pipelines.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def bench_storage(session: nox.Session) -> None:
    """Packages loaded by URL from moto's S3 server and s3rver against local disk: cold download
    bandwidth against s3fs alone, a cached load against a local one, peak memory (1 MiB and 1 GiB;
    about 10 min, 4 GB of disk)."""
    session.install(f"{CORE}[s3]")
    botocore = session.run("python", "-c", "import botocore; print(botocore.__version__)", silent=True)
    session.install("moto[server]>=5", f"botocore=={str(botocore).strip()}")
    # s3rver, an S3 server on Node.js that reads only the range asked (moto reads the whole object).
    s3rver = Path(session.virtualenv.location) / "s3rver"
    command = s3rver / "node_modules" / ".bin" / "s3rver"
    env = {}
    if shutil.which("npm") is None:
        session.warn("npm is not installed: measured against moto's S3 server only")
    else:
        if not command.exists():
            session.run("npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(s3rver), "s3rver@3.7.1",
                        external=True)  # fmt: skip
        env["NEUROPOD_BENCH_S3RVER"] = str(command)
    session.run("python", "bench/bench_storage.py", *session.posargs, env=env)


@nox.session(python=DEFAULT_PYTHON)
def bench_ray(session: nox.Session) -> None:
    """The Ray Serve deployment (1 and 2 replicas) against neuropod serve, REST and gRPC, same model,
    load and machine, with a no-model Ray deployment as Ray's floor (about 4 min; wrk, taskset, two
    cores). No tritonclient: it pins protobuf < 7 and Ray needs 7."""
    session.install(f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"{SERVING}[ray]", "ray[serve]==2.60.0",
                    f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx")  # fmt: skip
    session.run("python", "bench/bench_ray.py", *session.posargs)


@nox.session(python=DEFAULT_PYTHON)
def charts(session: nox.Session) -> None:
    """The charts of docs/performance.md: the quick in-process benches (ONNX, TorchScript, torch.export
    and AOTInductor, JAX, TensorFlow, OPE) write --json into docs/_static/perf/data/, then
    bench/charts.py draws docs/_static/perf/*.svg from it (about 10 min on two cores, most of it
    AOTInductor compiling). `nox -s charts -- --from-data` only redraws from the committed JSON. The serving
    chart comes from `nox -s bench_serve -- --json docs/_static/perf/data/serve.json` (too long to run here)."""
    session.install("matplotlib==3.11.2")
    data = Path("docs/_static/perf/data")
    if "--from-data" not in session.posargs:
        session.install(
            f"{CORE}", f"{ROOT / 'plugins/neuropod-onnx'}", f"onnxruntime=={ONNXRUNTIME_DEFAULT}", "onnx",
            f"{ROOT / 'plugins/neuropod-torchscript'}", f"torch=={TORCH_DEFAULT}",
            f"{ROOT / 'plugins/neuropod-tensorflow'}", f"tensorflow-cpu=={TENSORFLOW_DEFAULT}",
            f"{ROOT / 'plugins/neuropod-torch'}", f"{ROOT / 'plugins/neuropod-jax'}", f"jax=={JAX_DEFAULT}",
            f"jaxlib=={JAX_DEFAULT}",
        )
        benches = ["onnx", "torchscript", "torch", "jax", "tensorflow", "ope"]
        if not (ROOT.parent / "shared/fixtures/uber-neuropod-0.3").is_dir():  # bench_tensorflow's packages
            session.warn("no ../shared/fixtures/uber-neuropod-0.3: the TensorFlow figures keep their committed JSON")
            benches.remove("tensorflow")
        for name in benches:  # one process each: torch and TensorFlow do not share one
            session.run("python", f"bench/bench_{name}.py", "--quick", "--json", str(data / f"{name}.json"))
    session.run("python", "bench/charts.py", "--data", str(data), "--out", "docs/_static/perf")


@nox.session(python=DEFAULT_PYTHON)
def build(session: nox.Session) -> None:
    """Wheels and sdists for the core and every plugin, into dist/."""
    session.install("build", "twine")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for project in [CORE, *PLUGINS, SERVING]:
        session.run("python", "-m", "build", "--outdir", str(dist), str(project))
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.iterdir()))
    _check_plugin_needs_our_core(session, dist)


def _check_plugin_needs_our_core(session: nox.Session, dist: Path) -> None:
    """A plugin wheel offered without our core must fail to install, not pull another `neuropod`."""
    wheels = Path(tempfile.mkdtemp(prefix="plugin-only-"))
    for whl in dist.glob("neuropod_onnx-*.whl"):
        shutil.copy(whl, wheels)
    venv = Path(tempfile.mkdtemp(prefix="venv-")) / "v"
    session.run("python", "-m", "venv", str(venv))
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    out = session.run(
        str(py), "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheels), "neuropod-onnx",
        success_codes=[1], silent=True, external=True,
    )
    if "No matching distribution found for neuropod" not in str(out):
        session.error(f"installing the plugin alone did not fail on the missing core:\n{out}")
    session.log("ok: the plugin alone fails with 'No matching distribution found for neuropod<0.5,>=0.4'")


# --- third-party backends: the example outside plugin, and installable wheels --

EXAMPLE = ROOT / "examples" / "neuropod-numpy-backend"


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])
def tests_example(session: nox.Session) -> None:
    """The outside backend in examples/ (numpy-expr), conformance suite included."""
    session.install(f"{CORE}", f"{EXAMPLE}[test]")
    with session.chdir(EXAMPLE):
        _pytest(session, "tests")


_WHEEL_SMOKE = """
import sys, tempfile
from pathlib import Path
import numpy as np
import neuropod
from neuropod.packagers import create_onnx_neuropod
from neuropod_onnx.demo import INPUT_SPEC, OUTPUT_SPEC, demo_model_bytes

assert "site-packages" in neuropod.__file__, neuropod.__file__  # the wheel, not a source tree
assert neuropod.__version__ == "0.4.0", neuropod.__version__
x = np.array([[1, 2], [3, 4]], np.float32)
y = np.array([[10, 20], [30, 40]], np.float32)
with tempfile.TemporaryDirectory() as tmp:
    path = create_onnx_neuropod(
        Path(tmp) / "adder.neuropod", "adder", INPUT_SPEC, OUTPUT_SPEC, onnx_model=demo_model_bytes(),
        test_input_data={"x": x, "y": y}, test_expected_out={"out": (x + y) * 2},
    )
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x, "y": y})
np.testing.assert_array_equal(out["out"], (x + y) * 2)
print("smoke test passed:", model.backend.id, out["out"].tolist())
"""


@nox.session(python=DEFAULT_PYTHON, tags=["ci"])  # about 30 s
def wheels(session: nox.Session) -> None:
    """Wheels for the core and every plugin into dist/, checked, and installed
    into a fresh venv with the documentation's line, ``pip install
    --find-links dist neuropod 'neuropod-onnx[cpu]'`` (our wheels from dist/,
    third-party dependencies from the index), for a smoke test: package, load,
    infer, ``neuropod backends``."""
    import zipfile
    from email.parser import Parser

    session.install("build", "twine")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for project in [CORE, *PLUGINS, SERVING]:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), str(project), silent=True)
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.glob("*.whl")))

    # Metadata: name, version, license, readme, classifiers, and every plugin's core range.
    for whl in sorted(dist.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(zf.read(meta_name).decode())
        name, requires = meta["Name"], meta.get_all("Requires-Dist") or []
        problems = [f for f in ("Version", "License-Expression", "Description-Content-Type") if not meta.get(f)]
        problems += [] if meta.get_all("Classifier") else ["Classifier"]
        if name != "neuropod" and "neuropod<0.5,>=0.4" not in requires:
            problems.append(f"Requires-Dist has no 'neuropod<0.5,>=0.4' ({requires})")
        if problems:
            session.error(f"{whl.name}: metadata lacks {', '.join(problems)}")
        session.log(f"ok: {whl.name}: {name} {meta['Version']}, requires {[r for r in requires if 'extra' not in r]}")

    venv = Path(tempfile.mkdtemp(prefix="neuropod-wheels-")) / "venv"
    session.run("python", "-m", "venv", str(venv))
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = str(bindir / "python")
    # The install line of the documentation, as written: our wheels from dist/, their third-party
    # requirements from the index, and pip picking our neuropod 0.4 over PyPI's unrelated 0.2.
    session.run(py, "-m", "pip", "install", "--quiet", "--find-links", str(dist), "neuropod", "neuropod-onnx[cpu]",
                external=True)  # fmt: skip
    session.run(py, "-m", "pip", "check", external=True)
    installed = session.run(py, "-m", "pip", "list", "--format=freeze", external=True, silent=True)
    for wanted in ("neuropod==0.4.0", "neuropod-onnx==0.4.0", "onnxruntime=="):
        if wanted not in str(installed):
            session.error(f"pip install --find-links dist neuropod 'neuropod-onnx[cpu]' did not install {wanted}")
    onnxruntime = next(line.split("==")[1] for line in str(installed).splitlines() if line.startswith("onnxruntime=="))
    with session.chdir(tempfile.gettempdir()):  # away from the source tree
        session.run(py, "-c", _WHEEL_SMOKE, external=True, env={"NEUROPOD_CACHE_DIR": str(venv.parent / "cache")})
        out = session.run(str(bindir / "neuropod"), "backends", external=True, silent=True)
    if f"onnx=={onnxruntime}" not in str(out) or "neuropod-onnx 0.4.0" not in str(out):
        session.error(f"neuropod backends does not list the ONNX backend from the wheels:\n{out}")
    session.log(f"ok: neuropod backends lists onnx=={onnxruntime} from neuropod-onnx 0.4.0")
