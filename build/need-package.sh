#!/usr/bin/env bash
# Installs a Debian package when a check fails, where this runs as root with apt-get.
#
# Usage: build/need-package.sh [--soft] PACKAGE CHECK WHY...
#   CHECK  a shell condition that holds once the package is there ("command -v bwrap")
#   WHY    what the package is for, said when it is installed or missing
#   --soft where it cannot be installed, say so and go on (exit 0) instead of failing
set -euo pipefail
soft=0
if [ "${1:-}" = "--soft" ]; then soft=1; shift; fi
pkg="${1:?usage: need-package.sh [--soft] PACKAGE CHECK WHY}"
check="${2:?usage: need-package.sh [--soft] PACKAGE CHECK WHY}"
shift 2
why="$*"
if bash -c "$check" >/dev/null 2>&1; then exit 0; fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing $pkg ($why)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq "$pkg" >/dev/null 2>&1 || \
    { apt-get update -qq >/dev/null && apt-get install -y -qq "$pkg" >/dev/null; }; } || {
    echo "apt-get could not install $pkg ($why): install it and run make again" >&2
    exit 1
  }
  bash -c "$check" >/dev/null 2>&1 || { echo "$pkg is installed but '$check' still fails" >&2; exit 1; }
elif [ "$soft" = 1 ]; then
  echo "NOTE: the package $pkg is missing ($why) and apt-get as root is not available to install it"
else
  echo "the package $pkg is missing ($why): install it (apt-get install $pkg) and run make again" >&2
  exit 1
fi
