# Tutor — the two commands a new machine needs: `make quickstart` and `make test`.
# Both install what is missing first (a project-local Python venv with PyTorch 2.11.0,
# whose libtorch the Rust crates link against, and requirements-dev.txt: pytest, used to
# grade episodes, and transformers, which makes the policy crate's parity references).

SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PYTHON ?= python3
TORCH_VERSION := 2.11.0

# torch-sys reads libtorch's location and ABI from `python` on PATH (.cargo/config.toml
# sets LIBTORCH_USE_PYTORCH); workers grade with the venv's pytest.
export PATH := $(VENV)/bin:$(PATH)
export TUTOR_PYTHON := $(VENV)/bin/python
export CARGO_TERM_COLOR ?= never

.PHONY: setup sandbox-tools build release images quickstart test check-layout bench-ingest bench-policy clean-runs help

help:
	@echo "make quickstart   set up, build (release) and run configs/quickstart.toml"
	@echo "make test         set up, build and run the whole test suite (check-layout first)"
	@echo "make sandbox-tools install bubblewrap (confines local sandboxes) and the plots' font (part of setup)"
	@echo "make check-layout no unused dependencies, no files of a crate importing each other"
	@echo "make bench-ingest coordinator ingest throughput (release; BENCH_ARGS=... to change)"
	@echo "make bench-policy generation and training step against transformers/PyTorch (CPU)"

setup: $(VENV)/.ready sandbox-tools

# bubblewrap confines the local sandbox's commands (docs/security.md, "Local sandbox"):
# without it a worker refuses local sandboxes unless `[worker] allow_unconfined = true`,
# and the confinement tests say SKIPPED. `tutor report` draws its plots' text with DejaVu
# Sans (fonts-dejavu-core), read at run time. Both installed with apt-get where this runs
# as root.
PLOT_FONT := /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing bubblewrap (bwrap) for the local sandbox"; \
			{ apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
			  { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }; } || \
			{ echo "apt-get could not install bubblewrap: install it (package bubblewrap) and run make again"; exit 1; }; \
		else \
			echo "NOTE: bubblewrap (bwrap) is missing and apt-get (as root) is not available to install it:"; \
			echo "      install the package bubblewrap yourself; until then local sandboxes are refused"; \
			echo "      (or run unconfined with [worker] allow_unconfined = true: docs/security.md)"; \
		fi; \
	}
	@command -v bwrap >/dev/null 2>&1 && echo "sandbox tools ready: $$(bwrap --version)" || true
	@test -f $(PLOT_FONT) || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing fonts-dejavu-core (the text of \`tutor report\`'s plots)"; \
			{ apt-get install -y -qq fonts-dejavu-core >/dev/null 2>&1 || \
			  { apt-get update -qq >/dev/null && apt-get install -y -qq fonts-dejavu-core >/dev/null; }; } || \
			{ echo "apt-get could not install fonts-dejavu-core: install it and run make again"; exit 1; }; \
		else \
			echo "NOTE: $(PLOT_FONT) is missing and apt-get (as root) is not available to install it:"; \
			echo "      install the package fonts-dejavu-core, or set TUTOR_PLOT_FONT to a .ttf file;"; \
			echo "      until then \`tutor report\` cannot draw its plots"; \
		fi; \
	}

# The stamp depends on the requirements file, so adding or re-pinning a package there
# re-runs the install on machines that already have a venv.
$(VENV)/.ready: requirements-dev.txt
	@command -v git >/dev/null || { echo "git is required (apt-get install git)"; exit 1; }
	@command -v cargo >/dev/null || { echo "a Rust toolchain is required (cargo)"; exit 1; }
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)" -r requirements-dev.txt
	@$(VENV)/bin/python -c "import torch, pytest, transformers, safetensors; print('venv ready: torch', torch.__version__, '| transformers', transformers.__version__)"
	@touch $@

build: setup
	cargo build --bin tutor

release: setup
	cargo build --release --bin tutor

quickstart: release
	./target/release/tutor run --config configs/quickstart.toml

# Sandbox images, built locally (no registry is reachable): a Debian base from
# debootstrap, then the Python task image on it. Skipped, with a note, where no Docker
# engine answers; the Docker tests then say they were skipped.
images:
	@if docker info >/dev/null 2>&1; then \
		deploy/images/build-base.sh tutor/base:bookworm && \
		docker build -q -t tutor/python-task:latest deploy/images/python-task >/dev/null && \
		echo "image tutor/python-task:latest ready"; \
	else \
		echo "no Docker engine reachable: sandbox images not built"; \
	fi

# The layout's rules (docs/architecture.md): no dependency a crate never uses, no two
# files of a crate that import each other, and the page's crate graph and paths true to
# the code. Python alone, so they fail in seconds.
check-layout:
	@$(PYTHON) build/check-unused-deps.py
	@$(PYTHON) build/check-module-cycles.py
	@$(PYTHON) build/check-architecture-doc.py

test: check-layout build images
	@if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --workspace --no-fail-fast; \
	else \
		cargo test --workspace --no-fail-fast; \
	fi

# Coordinator ingest throughput over loopback, fsync on (bench/README.md). Not part of
# `make test`. The bench crate links libtorch (other benchmarks use the policy), hence setup.
# Example: make bench-ingest BENCH_ARGS="--workers 32 --window 16"
BENCH_ARGS ?=
bench-ingest: setup
	cargo build --release -p tutor-bench --bin ingest
	./target/release/ingest $(BENCH_ARGS)

# The policy against transformers' generate and a PyTorch eager training step on the same
# model, CPU, same thread count (bench/README.md). Starts bench/reference/*.py with the venv.
# Example: make bench-policy BENCH_ARGS="--threads 1 --batches 1,8,16"
bench-policy: setup
	cargo build --release -p tutor-bench --bin policy
	./target/release/policy $(BENCH_ARGS)

clean-runs:
	rm -rf runs
