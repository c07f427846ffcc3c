#!/usr/bin/env bash
# Every GPU path of Tutor, checked in one go, one report (issue 17 item 7). Two steps,
# because the GPU machines carry PyTorch but no Rust toolchain:
#
#   scripts/gpu-check.sh build         # here: release-builds bench's gpu_check into
#                                      # .gpu-check/ (ignored by git; about 20 MB)
#   scripts/gpu-check.sh run [OUT]     # on the GPU machine, from the repository root:
#                                      # the binary against the torch already there
#
# With the device tool: `run` with carry [".gpu-check"] and the command
# `scripts/gpu-check.sh run $OUT`. On a machine with both cargo and a GPU, `run` builds
# first when .gpu-check/gpu_check is missing (or `make gpu-check` does both).
#
# `run` finds libtorch and libnccl in the Python that has torch (GPU_CHECK_PYTHON, else
# TUTOR_PYTHON, else python3): LD_LIBRARY_PATH gets torch/lib and every nvidia/*/lib
# beside it, and a libnccl.so link to pip's libnccl.so.2 (cudarc loads libnccl.so). The
# report is OUT/gpu-report.md and OUT/gpu-report.json (format: bench/README.md, "GPU
# check"); the exit status is non-zero when a check failed. Extra arguments after OUT go
# to gpu_check (e.g. --checks parity,nccl; --device cpu --small for a dry run here).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-check/gpu_check

build() {
    [ -x .venv/bin/python ] || make setup
    PATH="$PWD/.venv/bin:$PATH" cargo build --release -p tutor-bench --bin gpu_check
    mkdir -p .gpu-check
    cp target/release/gpu_check "$BIN"
    strip "$BIN" 2>/dev/null || true
    echo "built $BIN ($(du -h "$BIN" | cut -f1)); on the GPU machine: scripts/gpu-check.sh run OUT"
}

run() {
    local out=${1:-gpu-check-report}
    shift || true
    if [ ! -x "$BIN" ]; then
        if command -v cargo >/dev/null; then build; else
            echo "error: $BIN is missing and there is no cargo here: run 'scripts/gpu-check.sh build' on a machine with Rust and bring .gpu-check/ along" >&2
            exit 2
        fi
    fi
    local py=${GPU_CHECK_PYTHON:-${TUTOR_PYTHON:-python3}}
    local torch_dir
    torch_dir=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))') || {
        echo "error: $py cannot import torch; set GPU_CHECK_PYTHON to a Python with torch and transformers" >&2
        exit 2
    }
    local site libs nccl_dir
    site=$(dirname "$torch_dir")
    libs="$torch_dir/lib"
    for d in "$site"/nvidia/*/lib; do
        [ -d "$d" ] && libs="$libs:$d"
    done
    nccl_dir=$(mktemp -d)
    local so
    so=$(ls "$site"/nvidia/nccl/lib/libnccl.so* "$site"/nvidia/*/lib/libnccl.so* 2>/dev/null | head -1 || true)
    if [ -n "$so" ]; then ln -sf "$so" "$nccl_dir/libnccl.so"; else
        echo "note: no libnccl.so* under $site/nvidia: the NCCL checks will fail to load it" >&2
    fi
    export LD_LIBRARY_PATH="$nccl_dir:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    mkdir -p "$out"
    echo "gpu-check: python $py (torch at $torch_dir), libnccl ${so:-missing}, report in $out"
    "$BIN" --out "$out" --work "${GPU_CHECK_WORK:-$(mktemp -d)}" --python "$py" --reference bench/reference/gpu_reference.py "$@"
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: scripts/gpu-check.sh build | run [OUT] [gpu_check args...]" >&2; exit 2 ;;
esac
