#!/usr/bin/env bash
# The GPU suite on a GPU machine without network (one that already has Python 3.12, a CUDA torch,
# numpy, pluggy, packaging, nvidia-ml-py, pytest and hypothesis; JAX with its CUDA plugin and
# pytest-xdist are used when there).
# `nox -s tests_gpu` is the way on a GPU machine that can reach PyPI; this is the way on one that cannot.
#
#   bash tests/gpu/offline.sh prepare DIR    here, with network: our wheels and the missing ones into DIR
#                                            (about 18 MB: the server's libraries and tritonclient included);
#                                            with ORT_GPU_TOO=1 also onnxruntime-gpu (255 MB) into DIR/big,
#                                            split in 48 MiB parts (a transfer may be limited to 64 MiB)
#   bash tests/gpu/offline.sh run DIR        there, from the repository root, DIR holding the wheels (and
#                                            DIR/onnxruntime_gpu-*.whl once the parts are joined and checked)
#
# `run` installs with --no-deps --target (nothing else is touched), replaces the machine's CPU onnxruntime
# with the GPU build when DIR has it, and runs with NEUROPOD_REQUIRE_GPU=1 (a GPU test that cannot run fails
# instead of skipping), most telling first, each step bounded so that the whole fits BUDGET seconds
# (default 480): the `gpu`-marked tests of every suite, bench/bench_gpu.py --quick, then whole suites
# (in parallel with pytest-xdist when it is there). A step the budget cannot fit is listed as skipped.
# One line per step goes to summary.txt and the logs to logs.tgz, in $OUT when set (two files: a device
# tool that brings back a few files only gets both).
set -uo pipefail
cmd=${1:?usage: offline.sh prepare|run DIR}
dir=${2:?usage: offline.sh prepare|run DIR}
py=${PYTHON:-python3}
ORT_GPU=1.31.1
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

case "$cmd" in
prepare)
    set -e
    mkdir -p "$dir"
    "$py" -m pip wheel -q --no-deps -w "$dir" ./core ./plugins/neuropod-onnx ./plugins/neuropod-torchscript \
        ./plugins/neuropod-torch ./plugins/neuropod-python ./plugins/neuropod-tensorrt ./plugins/neuropod-jax ./serving
    # importlib-metadata 8 (10 needs a package that is not there); onnxruntime-extensions for the custom-op
    # tests; the server's libraries (grpcio and protobuf in the versions grpcio-health-checking's stubs need);
    # tritonclient with what its HTTP client imports.
    "$py" -m pip download -q --no-deps "${platform[@]}" -d "$dir" 'importlib-metadata>=8,<9' onnxruntime-extensions \
        starlette uvicorn httptools orjson 'grpcio==1.81.1' 'grpcio-health-checking==1.81.1' 'protobuf>=6.31,<7' \
        'tritonclient==2.73.0' geventhttpclient gevent greenlet zope.event zope.interface brotli python-rapidjson
    if [ "${ORT_GPU_TOO:-0}" = 1 ]; then
        mkdir -p "$dir/big"
        "$py" -m pip download -q --no-deps "${platform[@]}" -d "$dir/big" "onnxruntime-gpu==$ORT_GPU"
        (cd "$dir/big" && for whl in onnxruntime_gpu-*.whl; do sha256sum "$whl" > "$whl.sha256"; split -b 48M "$whl" "$whl.part-"; rm "$whl"; done)
        echo "Send $dir without big/ in one call, then one big/*.part-* per call (join: cat PARTS > WHEEL; sha256sum -c WHEEL.sha256)."
    fi
    du -sh "$dir"
    ;;
run)
    start=$(date +%s) budget=${BUDGET:-480}
    site=/tmp/neuropod-site logs=/tmp/neuropod-gpu-logs out=${OUT:-/tmp/neuropod-gpu-out}
    rm -rf "$site" "$logs"
    mkdir -p "$logs" "$out"
    summary=$out/summary.txt
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl > "$logs/install.log" 2>&1 \
        || { cat "$logs/install.log"; exit 1; }
    if ls "$dir"/onnxruntime_gpu-*.whl >/dev/null 2>&1; then
        "$py" -m pip uninstall -y -q onnxruntime || true   # two builds own one module: keep the GPU one
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export NEUROPOD_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        "$py" -m neuropod backends
    } > "$summary" 2>&1
    xdist=()
    "$py" -c "import xdist" 2>/dev/null && xdist=(-n 6)
    pt=("$py" -m pytest -q -rfEs -p no:cacheprovider)
    status=0
    step() {  # step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less if the budget is nearly spent)
        local name=$1 limit=$2 left
        shift 2
        left=$((budget - ($(date +%s) - start)))
        if [ "$left" -lt 20 ]; then echo "$name: skipped (budget spent)" >> "$summary"; return; fi
        [ "$limit" -gt "$left" ] && limit=$left
        local t0=$(date +%s) rc=0
        NEUROPOD_HOME=$(mktemp -d) NEUROPOD_CACHE_DIR=$(mktemp -d) XDG_CACHE_HOME=$(mktemp -d) \
            timeout -k 5 "$limit" "$@" > "$logs/$name.log" 2>&1 || rc=$?
        [ "$rc" = 0 ] || [ "$rc" = 5 ] || status=1   # 5: nothing selected (a suite without gpu tests)
        echo "$name: rc=$rc $(($(date +%s) - t0))s | $(tail -n 1 "$logs/$name.log")" >> "$summary"
    }
    # The python plugin's lock environments install from PyPI: not reachable there.
    no_pypi=(--ignore=plugins/neuropod-python/tests/test_requirements.py)
    step gpu_host 90 "${pt[@]}" tests/gpu
    for plugin in torchscript torch jax onnx tensorrt python; do
        step "gpu_$plugin" 150 "${pt[@]}" -m gpu "plugins/neuropod-$plugin/tests"
    done
    step gpu_serving 90 "${pt[@]}" -m gpu serving/tests/test_shared_memory.py serving/tests/test_config_override.py \
        serving/tests/test_gpu_instance_groups.py
    step bench_gpu 150 "$py" bench/bench_gpu.py --quick
    # torch alone compiling and loading an AOTInductor package (a crash there is torch's, not ours)
    step aoti_probe 150 "$py" tests/gpu/aoti_probe.py
    step full_torchscript 120 "${pt[@]}" "${xdist[@]}" plugins/neuropod-torchscript/tests
    step full_jax 60 "${pt[@]}" "${xdist[@]}" plugins/neuropod-jax/tests
    step full_core 120 "${pt[@]}" "${xdist[@]}" core/tests
    step full_python 60 "${pt[@]}" "${xdist[@]}" plugins/neuropod-python/tests "${no_pypi[@]}"
    step full_onnx 90 "${pt[@]}" "${xdist[@]}" plugins/neuropod-onnx/tests
    step full_torch 300 "${pt[@]}" "${xdist[@]}" plugins/neuropod-torch/tests
    (cd "$logs" && tar czf "$out/logs.tgz" ./*.log)
    echo "done in $(($(date +%s) - start)) s" >> "$summary"
    cat "$summary"
    exit $status
    ;;
*)
    echo "usage: offline.sh prepare|run DIR" >&2
    exit 2
    ;;
esac
