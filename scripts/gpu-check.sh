#!/usr/bin/env bash
# Every GPU path of Tutor, checked in one go, one report (issue 17 item 7). Two steps,
# because the GPU machines carry PyTorch but no Rust toolchain:
#
#   scripts/gpu-check.sh build         # here: release-builds bench's gpu_check into
#                                      # .gpu-check/ (ignored by git; about 20 MB)
#   scripts/gpu-check.sh run [OUT]     # on the GPU machine, from the repository root:
#                                      # the binary against the torch already there
#   scripts/gpu-check.sh benches [OUT]  # the GPU rows of the engine benches (prefix_cache,
#                                      # weights_move with --device cuda), OUT/benches.md
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

BENCHES=(prefix_cache weights_move)

build() {
    [ -x .venv/bin/python ] || make setup
    local bins=(--bin gpu_check)
    for b in "${BENCHES[@]}"; do bins+=(--bin "$b"); done
    PATH="$PWD/.venv/bin:$PATH" cargo build --release -p tutor-bench "${bins[@]}"
    mkdir -p .gpu-check
    for b in gpu_check "${BENCHES[@]}"; do
        cp "target/release/$b" ".gpu-check/$b"
        strip ".gpu-check/$b" 2>/dev/null || true
    done
    echo "built .gpu-check/ ($(du -sh .gpu-check | cut -f1)); on the GPU machine: scripts/gpu-check.sh run OUT"
}

need() {
    if [ ! -x ".gpu-check/$1" ]; then
        if command -v cargo >/dev/null; then build; else
            echo "error: .gpu-check/$1 is missing and there is no cargo here: run 'scripts/gpu-check.sh build' on a machine with Rust and bring .gpu-check/ along" >&2
            exit 2
        fi
    fi
}

# LD_LIBRARY_PATH for the torch (and pip's NCCL) of the Python that has torch.
torch_libs() {
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
    PY=$py
    echo "gpu-check: python $py (torch at $torch_dir), libnccl ${so:-missing}"
}

run() {
    local out=${1:-gpu-check-report}
    shift || true
    need gpu_check
    torch_libs
    mkdir -p "$out"
    echo "gpu-check: report in $out"
    local py=$PY
    "$BIN" --out "$out" --work "${GPU_CHECK_WORK:-$(mktemp -d)}" --python "$py" --reference bench/reference/gpu_reference.py "$@"
}

# The engine benches' GPU rows (bench/README.md, `prefix_cache` and `weights_move`):
# decoding with cuDNN's attention off and on, a 12-turn episode on a Qwen3-0.6B-sized
# engine with and without the prefix cache (twice:
# libtorch's default threads, then 4), and a 0.5B version moved into an engine on the GPU
# by each path. OUT/benches.md.
benches() {
    local out=${1:-gpu-check-report}
    for b in "${BENCHES[@]}"; do need "$b"; done
    torch_libs
    mkdir -p "$out"
    {
        echo "# GPU rows of the engine benches"
        echo
        echo "- machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
        echo
        # Decoding with cuDNN's attention off (Tutor's default) and on. On, it builds a
        # plan per new key length, ~50 ms per decoded token on an H100/H200 (2026-11-28,
        # bench/README.md), which gpu_check's generate (best of repeats) cannot see.
        for cudnn in 0 1; do
            echo "## prefix_cache --without-only --policy-generate, 2 layers, TUTOR_CUDNN_ATTENTION=$cudnn"
            echo '```'
            { TUTOR_CUDNN_ATTENTION=$cudnn timeout 60 .gpu-check/prefix_cache --device cuda --hidden 1024 --layers 2 \
                --vocab 1000 --turns 3 --first 200 --observation 50 --reply 32 --without-only --policy-generate 2>&1 \
                || echo "prefix_cache failed or timed out ($?)"; } | { grep -v 'turn [0-9]' || true; }
            echo '```'
        done
        # 12 turns, with libtorch's default threads and with 4 (as gpu_check's generate
        # check). PREFIX_THREADS / PREFIX_TIMEOUT (seconds per run) shorten it on a tight
        # budget.
        for threads in ${PREFIX_THREADS:-0 4}; do
            echo "## prefix_cache --device cuda --hidden 1024 --layers 28 --vocab 151936 --turns 12 --first 1000 --observation 200 --reply 32 --threads $threads"
            echo '```'
            timeout "${PREFIX_TIMEOUT:-240}" .gpu-check/prefix_cache --device cuda --hidden 1024 --layers 28 --vocab 151936 \
                --turns 12 --first 1000 --observation 200 --reply 32 --threads "$threads" 2>&1 \
                || echo "prefix_cache failed or timed out ($?)"
            echo '```'
        done
        echo
        echo "## weights_move --device cuda --repeat 3"
        echo '```'
        .gpu-check/weights_move --device cuda --repeat 3 2>&1 || echo "weights_move failed ($?)"
        echo '```'
    } | tee "$out/benches.md"
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    benches) shift; benches "$@" ;;
    *) echo "usage: scripts/gpu-check.sh build | run [OUT] [gpu_check args...] | benches [OUT]" >&2; exit 2 ;;
esac
