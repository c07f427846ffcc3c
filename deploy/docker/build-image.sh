#!/usr/bin/env bash
# Builds the `tutor` image from a binary already built on this host: the release one
# (`make image`), or the debug one of `make test`'s test build (`make test-image`).
#
# Usage: deploy/docker/build-image.sh cpu|gpu TAG BINARY
#   cpu  the binary with its CUDA libraries unlinked, and only the libraries it then
#        needs (libtorch_cpu, libc10, libgomp): runs anywhere, trains and generates on CPU
#   gpu  the binary as built (with the nccl feature) and every library of the pinned
#        PyTorch wheel and its nvidia-* wheels (CUDA runtime, cuBLAS, cuDNN, NCCL, ...)
# Environment: TUTOR_BASE_IMAGE (default tutor/base:bookworm, made by
# deploy/images/build-base.sh), PYTHON (the venv's python, which knows where torch is).
set -euo pipefail
variant="${1:?usage: build-image.sh cpu|gpu TAG BINARY}"
tag="${2:?usage: build-image.sh cpu|gpu TAG BINARY}"
binary="${3:?usage: build-image.sh cpu|gpu TAG BINARY}"
base="${TUTOR_BASE_IMAGE:-tutor/base:bookworm}"
python="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"

[ -x "$binary" ] || { echo "no binary at $binary: build it first (make release, or make test-build for the debug one)" >&2; exit 1; }
command -v patchelf >/dev/null || {
  echo "patchelf is missing (it points the binary at the image's libraries): apt-get install patchelf" >&2
  exit 1
}
torch_lib="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')" || {
  echo "$python cannot import torch: run make setup first" >&2
  exit 1
}
site="$(dirname "$(dirname "$torch_lib")")"

ctx="$(mktemp -d "${TMPDIR:-/tmp}/tutor-image-$variant.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/lib"
cp "$binary" "$ctx/tutor"
chmod u+w "$ctx/tutor"
strip --strip-unneeded "$ctx/tutor" 2>/dev/null || true

case "$variant" in
  cpu)
    # The build links libtorch and libtorch_cuda with --no-as-needed so that CUDA
    # registers itself (build/libtorch_rpath.rs). The binary calls nothing in either
    # directly: without them it is a CPU build, and the CUDA libraries (4 GB) stay out.
    for lib in libtorch_cuda.so libtorch.so; do
      if patchelf --print-needed "$ctx/tutor" | grep -qx "$lib"; then
        patchelf --remove-needed "$lib" "$ctx/tutor"
      fi
    done
    patchelf --set-rpath /opt/tutor/lib "$ctx/tutor"
    # What the dynamic loader resolves to the wheel's folders goes into lib/; the rest
    # (libc, libstdc++, libgcc_s, libm) is the base's.
    # (ldd's answers go to files first: `ldd | grep -q` can lose a match to SIGPIPE.)
    LD_LIBRARY_PATH="$torch_lib" ldd "$ctx/tutor" >"$ctx/ldd-host.txt"
    if grep -q "not found" "$ctx/ldd-host.txt"; then
      echo "a library of the binary is not found: ldd says" >&2
      cat "$ctx/ldd-host.txt" >&2
      exit 1
    fi
    awk '/=>/ {print $3}' "$ctx/ldd-host.txt" | while read -r path; do
      case "$path" in
        "$site"/*) cp -L "$path" "$ctx/lib/" ;;
      esac
    done
    LD_LIBRARY_PATH="$ctx/lib" ldd "$ctx/tutor" >"$ctx/ldd-staged.txt"
    if grep -q "not found" "$ctx/ldd-staged.txt"; then
      echo "the staged libraries leave symbols unresolved:" >&2
      grep "not found" "$ctx/ldd-staged.txt" >&2
      exit 1
    fi
    rm -f "$ctx/ldd-host.txt" "$ctx/ldd-staged.txt"
    ;;
  gpu)
    # Everything: CUDA loads much of itself lazily (cuDNN's sub-libraries, NVRTC, the
    # cuBLASLt kernels), so ldd's list is not enough.
    patchelf --set-rpath /opt/tutor/lib "$ctx/tutor"
    cp -L "$torch_lib"/*.so* "$ctx/lib/"
    for d in "$site"/nvidia/*/lib; do
      [ -d "$d" ] && cp -L "$d"/*.so* "$ctx/lib/" 2>/dev/null || true
    done
    # cudarc opens NCCL as libnccl.so, the wheel ships libnccl.so.2.
    [ -e "$ctx/lib/libnccl.so.2" ] && ln -sf libnccl.so.2 "$ctx/lib/libnccl.so"
    ;;
  *) echo "variant must be cpu or gpu, not $variant" >&2; exit 1 ;;
esac

docker image inspect "$base" >/dev/null 2>&1 || {
  echo "base image $base is missing: deploy/images/build-base.sh $base (or set TUTOR_BASE_IMAGE)" >&2
  exit 1
}
echo "building $tag ($variant) on $base: binary $(du -m "$ctx/tutor" | cut -f1) MB, libraries $(du -sm "$ctx/lib" | cut -f1) MB"
cp "$here/Dockerfile" "$ctx/Dockerfile"
# The legacy builder's deprecation notice is noise here: show the build's output only
# when it fails.
docker build -q --build-arg BASE="$base" --build-arg VARIANT="$variant" -t "$tag" "$ctx" \
  >"$ctx/build.log" 2>&1 || { cat "$ctx/build.log" >&2; exit 1; }
# The image must start on its own: no venv, no host libraries.
docker run --rm --entrypoint /usr/local/bin/tutor "$tag" --version >/dev/null || {
  echo "$tag does not start:" >&2
  docker run --rm --entrypoint /bin/sh "$tag" -c 'ldd /usr/local/bin/tutor' >&2 || true
  exit 1
}
echo "built $tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
