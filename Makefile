# Tutor — the two commands a new machine needs: `make quickstart` and `make test`.
# Both install what is missing first (a project-local Python venv with PyTorch 2.11.0,
# whose libtorch the Rust crates link against, and requirements-dev.txt: pytest, used to
# grade episodes, and transformers, which makes the policy crate's parity references).

SHELL := /bin/bash
VENV := $(CURDIR)/.venv
# The interpreter local sandboxes run and grade with: pytest and nothing else (a command
# there sees no torch or client libraries; pytest starts in half the time without the
# project venv's plugins).
SANDBOX_VENV := $(CURDIR)/.venv-sandbox
PYTHON ?= python3
TORCH_VERSION := 2.11.0

# torch-sys reads libtorch's location and ABI from `python` on PATH (.cargo/config.toml
# sets LIBTORCH_USE_PYTORCH); workers grade with the venv's pytest.
export PATH := $(VENV)/bin:$(PATH)
export TUTOR_PYTHON := $(VENV)/bin/python
export TUTOR_SANDBOX_PYTHON := $(SANDBOX_VENV)/bin/python
export CARGO_TERM_COLOR ?= never

.PHONY: setup sandbox-tools build release images image image-gpu test-build test-image lint compose-test compose-up compose-down compose-clean compose-logs compose-ps quickstart test check-layout bench-ingest bench-policy gpu-check clean-runs help

help:
	@echo "make quickstart   set up, build (release) and run configs/quickstart.toml"
	@echo "make test         set up, build and run the whole test suite (check-layout first)"
	@echo "make lint         clippy on every crate and target, nccl feature, warnings as errors (not part of make test)"
	@echo "make sandbox-tools install bubblewrap (confines local sandboxes) and the plots' font (part of setup)"
	@echo "make image        the tutor image (every role, CPU libtorch) from the release binary: $(IMAGE)"
	@echo "make image-gpu    the same with CUDA libtorch and NCCL: $(IMAGE_GPU) (about 4 GB)"
	@echo "make compose-test images, then the docker-compose stack's DAgger run with a killed and an added worker"
	@echo "make compose-up   start the docker-compose stack (deploy/compose), 3 workers; make compose-down stops it (the run's volume stays; compose-clean removes it)"
	@echo "                  ENGINE=1: the workers' student on one tutor serve the learner loads (deploy/compose/engine.yml)"
	@echo "make check-layout no unused dependencies, no files of a crate importing each other"
	@echo "make bench-ingest coordinator ingest throughput (release; BENCH_ARGS=... to change)"
	@echo "make bench-policy generation and training step against transformers/PyTorch (CPU)"
	@echo "make gpu-check    on a CUDA machine: every GPU path against PyTorch, one report (scripts/gpu-check.sh)"

setup: $(VENV)/.ready $(SANDBOX_VENV)/.ready sandbox-tools

# bubblewrap confines the local sandbox's commands (docs/security.md, "Local sandbox"):
# without it a worker refuses local sandboxes unless `[worker] allow_unconfined = true`,
# and the confinement tests say SKIPPED. `tutor report` draws its plots' text with DejaVu
# Sans (fonts-dejavu-core), read at run time. Both installed with apt-get where this runs
# as root.
PLOT_FONT := /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
sandbox-tools:
	@build/need-package.sh --soft bubblewrap "command -v bwrap" \
		"confines local sandboxes; without it they are refused unless [worker] allow_unconfined = true (docs/security.md)"
	@command -v bwrap >/dev/null 2>&1 && echo "sandbox tools ready: $$(bwrap --version)" || true
	@build/need-package.sh --soft fonts-dejavu-core "test -f $(PLOT_FONT)" \
		"the text of tutor report's plots; or set TUTOR_PLOT_FONT to a .ttf file"

# The stamp depends on the requirements file, so adding or re-pinning a package there
# re-runs the install on machines that already have a venv.
$(VENV)/.ready: requirements-dev.txt
	@command -v git >/dev/null || { echo "git is required (apt-get install git)"; exit 1; }
	@command -v cargo >/dev/null || { echo "a Rust toolchain is required (cargo)"; exit 1; }
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)" -r requirements-dev.txt
	@$(VENV)/bin/python -c "import torch, pytest, transformers, safetensors; print('venv ready: torch', torch.__version__, '| transformers', transformers.__version__)"
	@touch $@

$(SANDBOX_VENV)/.ready: requirements-sandbox.txt
	@test -x $(SANDBOX_VENV)/bin/python || $(PYTHON) -m venv $(SANDBOX_VENV)
	$(SANDBOX_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-sandbox.txt
	@$(SANDBOX_VENV)/bin/python -c "import pytest; print('sandbox venv ready: pytest', pytest.__version__)"
	@touch $@

# The debug binary with the `nccl` feature (libnccl is loaded at run time, so it builds
# with no CUDA present). `make test` does not use this target: its test build (test-build
# below) makes target/debug/tutor itself, with the tests' dependency features.
build: setup
	cargo build --bin tutor --features nccl

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

# The tutor image (deploy/docker): the release binary and the libtorch it needs on the
# sandbox images' Debian base. CPU: the binary without its CUDA libraries (about 0.5 GB of
# libtorch_cpu); GPU: built with NCCL, with every CUDA library of the torch wheel. The GPU
# binary has its own target folder, so the two builds do not undo each other.
IMAGE ?= tutor/tutor:latest
IMAGE_GPU ?= tutor/tutor:gpu
image: setup images
	@if docker info >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory release && \
		build/need-package.sh patchelf "command -v patchelf" "points the image's binary at its libraries" && \
		PYTHON=$(VENV)/bin/python deploy/docker/build-image.sh cpu $(IMAGE) target/release/tutor; \
	else \
		echo "no Docker engine reachable: $(IMAGE) not built"; \
	fi

image-gpu: setup images
	@docker info >/dev/null 2>&1 || { echo "no Docker engine reachable: cannot build $(IMAGE_GPU)"; exit 1; }
	cargo build --release --bin tutor --features nccl --target-dir target/gpu
	@build/need-package.sh patchelf "command -v patchelf" "points the image's binary at its libraries"
	PYTHON=$(VENV)/bin/python deploy/docker/build-image.sh gpu $(IMAGE_GPU) target/gpu/release/tutor

# docker-compose: Debian's docker-compose 1.x or the `docker compose` plugin, whichever is
# installed. The stack's token is made once and kept in .tutor/compose-token, the
# learner's and the workers' (derived from it) in .tutor/compose-learner-token and
# .tutor/compose-worker-token.
COMPOSE := $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
COMPOSE_FILE := deploy/compose/docker-compose.yml
# ENGINE=1: the student on one `tutor serve` that the learner loads (deploy/compose/engine.yml;
# its API key is made once and kept in .tutor/compose-engine-key). Give it to every
# compose target of such a stack (compose-logs, compose-down, ...), or they leave the
# engine out.
ENGINE ?=
COMPOSE_FILES := -f $(COMPOSE_FILE) $(if $(filter 1 yes true,$(ENGINE)),-f deploy/compose/engine.yml)
COMPOSE_PROJECT ?= tutor
WORKERS ?= 3
DOCKER_SOCKET ?= /var/run/docker.sock
compose-env = TUTOR_AUTH_TOKEN="$$(cat .tutor/compose-token)" TUTOR_LEARNER_TOKEN="$$(cat .tutor/compose-learner-token)" \
	TUTOR_WORKER_TOKEN="$$(cat .tutor/compose-worker-token)" \
	DOCKER_GID="$$(stat -c %g $(DOCKER_SOCKET))" \
	DOCKER_SOCKET=$(DOCKER_SOCKET) TUTOR_RUN=$(COMPOSE_PROJECT) TUTOR_IMAGE=$(IMAGE) \
	TUTOR_ENGINE_API_KEY="$$(cat .tutor/compose-engine-key)"
compose = $(compose-env) $(COMPOSE) $(COMPOSE_FILES) -p $(COMPOSE_PROJECT)

.tutor/compose-token .tutor/compose-engine-key:
	@mkdir -p .tutor && umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > $@

# The workers' token, derived from the run's (they get only this one).
.tutor/compose-worker-token: .tutor/compose-token
	@umask 077 && docker run --rm -e TUTOR_AUTH_TOKEN="$$(cat $<)" $(IMAGE) worker-token > $@

# The learner's token, derived from the run's (the coordinator calls the learner with it).
.tutor/compose-learner-token: .tutor/compose-token
	@umask 077 && docker run --rm -e TUTOR_AUTH_TOKEN="$$(cat $<)" $(IMAGE) learner-token > $@

compose-up: image .tutor/compose-learner-token .tutor/compose-worker-token .tutor/compose-engine-key
	$(compose) up -d --scale worker=$(WORKERS)
	@echo "metrics: http://$$($(compose) port coordinator 9300)/metrics"
	@echo "logs:    make compose-logs   (status: make compose-ps)"

compose-logs: .tutor/compose-learner-token .tutor/compose-worker-token .tutor/compose-engine-key
	$(compose) logs -f --tail 50

compose-ps: .tutor/compose-learner-token .tutor/compose-worker-token .tutor/compose-engine-key
	$(compose) ps

# Down keeps the run's volume (the store, checkpoints, published versions); compose-clean
# removes it too. Both remove the run's sandbox containers that are left: a worker removes
# its own when it stops, but a killed worker's are only removed by a successor of the same
# name, and a recreated container has a new name.
compose-down: .tutor/compose-learner-token .tutor/compose-worker-token .tutor/compose-engine-key
	$(compose) down --remove-orphans
	@docker ps -aq --filter label=tutor.run=$(COMPOSE_PROJECT) | xargs -r docker rm -f >/dev/null

compose-clean: .tutor/compose-learner-token .tutor/compose-worker-token .tutor/compose-engine-key
	$(compose) down -v --remove-orphans
	@docker ps -aq --filter label=tutor.run=$(COMPOSE_PROJECT) | xargs -r docker rm -f >/dev/null

# The stack end to end (tests/tests/compose.rs) on the release image: built from scratch
# where no image exists. (The test starts no host binary, so no debug build of tutor.)
compose-test: check-layout image
	@if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run -p tutor-tests --test compose --no-fail-fast; \
	else \
		cargo test -p tutor-tests --test compose; \
	fi

# The layout's rules (docs/architecture.md): no dependency a crate never uses, no two
# files of a crate that import each other, and the page's crate graph and paths true to
# the code. Python alone, so they fail in seconds.
check-layout:
	@$(PYTHON) build/check-unused-deps.py
	@$(PYTHON) build/check-module-cycles.py
	@$(PYTHON) build/check-architecture-doc.py

# `make test` builds once: the test build (every crate, the nccl feature) also makes
# target/debug/tutor, the binary the cross-process tests start, and the compose tests'
# image is made from that same binary (stripped; tagged $(TEST_IMAGE), so the release
# image of `make image` is left as it is). A separate `cargo build --bin tutor` resolves
# dependency features without the tests' dev-dependencies (serde_json, getrandom) and so
# rebuilds most of the graph, and a release build for the image took 12 min of a CI run
# that must finish in 90 (2 cores, 2026-11-29: debug binary 973 s, release 718 s, clippy
# 381 s before the test build; the run that timed out spent 53 min before its first test).
TEST_IMAGE ?= tutor/tutor:test
NEXTEST = $(shell cargo nextest --version >/dev/null 2>&1 && echo yes)
TEST_ARGS := --workspace --features tutor/nccl
TEST_BIN := $(or $(CARGO_TARGET_DIR),target)/debug/tutor

test-build: setup
	$(if $(NEXTEST),cargo nextest run $(TEST_ARGS) --no-run,cargo test $(TEST_ARGS) --no-run)
	@test -x $(TEST_BIN) || { echo "the test build made no $(TEST_BIN)"; exit 1; }

test-image: test-build images
	@if docker info >/dev/null 2>&1; then \
		build/need-package.sh patchelf "command -v patchelf" "points the image's binary at its libraries" && \
		PYTHON=$(VENV)/bin/python deploy/docker/build-image.sh cpu $(TEST_IMAGE) $(TEST_BIN); \
	else \
		echo "no Docker engine reachable: $(TEST_IMAGE) not built"; \
	fi

test: check-layout test-image
	TUTOR_TEST_IMAGE=$(TEST_IMAGE) $(if $(NEXTEST),cargo nextest run $(TEST_ARGS) --no-fail-fast,cargo test $(TEST_ARGS) --no-fail-fast)

# Clippy on everything `make test` builds. Not part of it: a check build of the whole graph
# (6 min for one crate on 2 cores) that CI's time does not hold; run it before committing.
lint: setup
	cargo clippy --workspace --features tutor/nccl --all-targets -- -D warnings

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

# Every GPU path in one go (issue 17): bf16 parity against PyTorch, NCCL, training MFU,
# generation and broadcast figures; report in gpu-check-report/. On a GPU machine without
# Rust, build here (`scripts/gpu-check.sh build`) and run `scripts/gpu-check.sh run OUT` there.
gpu-check: setup
	scripts/gpu-check.sh build
	GPU_CHECK_PYTHON=$(VENV)/bin/python scripts/gpu-check.sh run gpu-check-report $(BENCH_ARGS)

clean-runs:
	rm -rf runs
