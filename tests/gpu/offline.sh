#!/usr/bin/env bash
# The GPU suite on a GPU machine without network (one that already has Python 3.12, a CUDA torch,
# numpy, pluggy, packaging, nvidia-ml-py, pytest and hypothesis, as the workplace's device machine does).
# `nox -s tests_gpu` is the way on a GPU machine that can reach PyPI; this is the way on one that cannot.
#
#   bash tests/gpu/offline.sh prepare DIR    here, with network: our wheels and the few missing ones into DIR;
#                                            onnxruntime-gpu (255 MB) into DIR/big, split in 48 MiB parts (a call carries at most 64 MiB, the repository included)
#   bash tests/gpu/offline.sh run DIR        there, from the repository root, DIR holding the wheels (and
#                                            DIR/onnxruntime_gpu-*.whl once the parts are joined and checked)
#
# `run` installs with --no-deps --target (nothing else is touched), replaces the machine's CPU onnxruntime
# with the GPU build when DIR has it, and runs every suite that needs no network with NEUROPOD_REQUIRE_GPU=1
# (a GPU test that cannot run fails instead of skipping), then bench/bench_gpu.py. Logs go to $OUT when set.
# JAX's GPU tests are not among them (jaxlib and its CUDA plugin are several hundred MB): run them with
# `nox -s tests_gpu` on a GPU machine that can reach PyPI.
set -euo pipefail
cmd=${1:?usage: offline.sh prepare|run DIR}
dir=${2:?usage: offline.sh prepare|run DIR}
py=${PYTHON:-python3}
ORT_GPU=1.31.1
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

case "$cmd" in
prepare)
    mkdir -p "$dir/big"
    "$py" -m pip wheel -q --no-deps -w "$dir" ./core ./plugins/neuropod-onnx ./plugins/neuropod-torchscript \
        ./plugins/neuropod-torch ./plugins/neuropod-python ./plugins/neuropod-tensorrt
    # importlib-metadata 8 (10 needs a package that is not there); onnxruntime-extensions for the custom-op tests.
    "$py" -m pip download -q --no-deps "${platform[@]}" -d "$dir" 'importlib-metadata>=8,<9' onnxruntime-extensions
    "$py" -m pip download -q --no-deps "${platform[@]}" -d "$dir/big" "onnxruntime-gpu==$ORT_GPU"
    (cd "$dir/big" && for whl in onnxruntime_gpu-*.whl; do sha256sum "$whl" > "$whl.sha256"; split -b 48M "$whl" "$whl.part-"; rm "$whl"; done)
    ls -la "$dir" "$dir/big"
    echo "Send $dir without big/ in one call, then one big/*.part-* per call (join: cat PARTS > WHEEL; sha256sum -c WHEEL.sha256)."
    ;;
run)
    site=/tmp/neuropod-site
    rm -rf "$site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl
    if ls "$dir"/onnxruntime_gpu-*.whl >/dev/null 2>&1; then
        "$py" -m pip uninstall -y -q onnxruntime || true   # two builds own one module: keep the GPU one
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export NEUROPOD_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
    logs=${OUT:-/tmp/neuropod-gpu-logs}
    mkdir -p "$logs"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu.txt" || true
    "$py" -m neuropod backends | tee -a "$logs/gpu.txt"
    status=0
    for suite in tests/gpu core/tests plugins/neuropod-onnx/tests plugins/neuropod-torchscript/tests \
                 plugins/neuropod-torch/tests plugins/neuropod-tensorrt/tests plugins/neuropod-python/tests; do
        name=$(echo "$suite" | tr '/' '_')
        extra=()
        # The python plugin's lock environments install from PyPI: not reachable there.
        [ "$suite" = plugins/neuropod-python/tests ] && extra=(--ignore=plugins/neuropod-python/tests/test_requirements.py)
        home=$(mktemp -d) cache=$(mktemp -d)
        NEUROPOD_HOME=$home NEUROPOD_CACHE_DIR=$cache XDG_CACHE_HOME=$(mktemp -d) \
            "$py" -m pytest -q -rfEs -p no:cacheprovider "$suite" "${extra[@]}" > "$logs/$name.log" 2>&1 || status=1
        echo "$suite: $(tail -n 1 "$logs/$name.log")"
    done
    "$py" bench/bench_gpu.py 2>&1 | tee "$logs/bench_gpu.txt" || status=1
    exit $status
    ;;
*)
    echo "usage: offline.sh prepare|run DIR" >&2
    exit 2
    ;;
esac
