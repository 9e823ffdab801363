# hvdkit: `make run` sets up and runs the demo; `make test` sets up and runs every test.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STACK := hvdkit/horovod_build/stack-cpu.txt
# A second pin file whose lines replace $(STACK)'s for the same packages (the GPU image:
# STACK_OVERRIDES=hvdkit/horovod_build/stack-gpu.txt, torch with CUDA and pip's CUDA compiler).
STACK_OVERRIDES ?=
STAMP := $(VENV)/.hvdkit-stack
PYTEST_ARGS ?=
# make test and test-all run the suite as two pytest runs side by side, split by test file
# (tests/lanes.py: the files that mostly wait beside the rest); LANES=1 runs one.
LANES ?= 2
# The flakiness sweep (tests/sweep.py): the multi-process tests, SWEEP_RUNS times, with
# SWEEP_LOAD CPU-bound processes beside them.
SWEEP_RUNS ?= 5
SWEEP_LOAD ?= 2
SWEEP_ARGS ?= -m multiprocess
# The frameworks set up: their pins from $(STACK) and a Horovod built for them (the images
# take it as a build argument; `make setup FRAMEWORKS=torch` leaves TensorFlow out).
# jax is Keras's third backend: installed, but Horovod has no binding for it to build.
FRAMEWORKS ?= torch,tensorflow,jax
comma := ,
HOROVOD_FRAMEWORKS = $(subst $() ,$(comma),$(filter-out jax,$(subst $(comma), ,$(FRAMEWORKS))))
# What Horovod is built with; EXTRA_BUILD_FLAGS adds to it (docker/Dockerfile.gpu: NCCL and
# the CUDA arch list).
EXTRA_BUILD_FLAGS ?=
BUILD_FLAGS ?= --frameworks $(HOROVOD_FRAMEWORKS) --controllers gloo,mpi $(EXTRA_BUILD_FLAGS)
# The linters `make lint` runs (CI too), pinned so that a new release cannot fail a build.
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1
LINT_STAMP := $(VENV)/.hvdkit-lint
# Ray and pyspark for the tests of hvdkit.ray and hvdkit.spark (not in the images).
ENGINES_STACK := hvdkit/horovod_build/stack-engines.txt
ENGINES_STAMP := $(VENV)/.hvdkit-engines
# The docs site's tools (mkdocs, Material, mkdocstrings), for `make docs` and tests/test_docs.py.
DOCS_STACK := hvdkit/horovod_build/stack-docs.txt
DOCS_STAMP := $(VENV)/.hvdkit-docs
# Where `make docs-check` saves its screenshots.
DOCS_CHECK_OUT ?= docs-check

.PHONY: setup stack engines docs docs-deps docs-check docs-figures run test test-fast test-all fuzz matrix image-gpu gpu-check lint profile-under-load startup-cost \
	sweep doctor clean

setup: $(STAMP)
	$(BIN)/hvdkit build-horovod $(BUILD_FLAGS)

$(STAMP): $(STACK) $(STACK_OVERRIDES) setup.cfg pyproject.toml
	$(MAKE) --no-print-directory stack
	$(BIN)/python -m pip install -q --disable-pip-version-check -e .
	touch $(STAMP)

# The pinned stack for FRAMEWORKS: a line of $(STACK) tagged `# framework: NAME` is kept only
# where NAME is in FRAMEWORKS. It needs only this file and $(STACK), so the images install it
# in a layer of its own, before hvdkit's code is copied in.
stack:
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: $(PYTHON) not found. hvdkit's stack is tested on Python 3.11 to 3.13."; \
	  echo "Fix: install one (apt-get install python3.11-venv, or pyenv install 3.12)"; \
	  echo "     or point at one: make setup PYTHON=/path/to/python3.11"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' || { \
	  echo "error: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'),"; \
	  echo "outside the 3.11 to 3.13 that hvdkit's stack is tested on."; \
	  echo "Fix: make setup PYTHON=/path/to/python3.11 (or python3.12, python3.13)"; exit 1; }
	@! test -x $(BIN)/python || [ "$$($(BIN)/python -c 'import sys; print(sys.version_info[:2])')" = \
	  "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ] || { \
	  echo "error: $(VENV) was made with another Python than $(PYTHON)."; \
	  echo "Fix: make clean first, or give this one a venv of its own: make setup PYTHON=$(PYTHON) VENV=.venv-other"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	awk -v keep=",$(FRAMEWORKS)," -v over="$(STACK_OVERRIDES)" \
	  'function pkg(l) { sub(/[ \t]*[=<>!~[;#].*/, "", l); return tolower(l) } \
	   /# framework: / && !index(keep, "," $$NF ",") { next } \
	   FILENAME == over { if (pkg($$0) != "") mine[pkg($$0)] = 1; print; next } \
	   !(pkg($$0) in mine)' $(STACK_OVERRIDES) $(STACK) > $(VENV)/stack.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check -r $(VENV)/stack.txt

run: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(BIN)/hvdkit run --hostfile hostfiles/localhost -- $(BIN)/python examples/keras_mnist.py --epochs 10

test: setup engines docs-deps
	$(BIN)/python tests/lanes.py --lanes $(LANES) -- $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# What CI leaves out for time (docs/development.md, "Tests and CI"): the tests marked `extra`,
# after everything CI runs. The two checks longer than that have their own targets:
# `make image-gpu` (the GPU image, ~25 min cold) and `make matrix` (fresh environments).
test-all: setup engines docs-deps
	HVDKIT_TEST_ALL=1 $(BIN)/python tests/lanes.py --lanes $(LANES) -- -m "not gpu_image" $(PYTEST_ARGS)

# A campaign of generated scenarios (issue 49): FUZZ_CASES cases of each generator (the torch
# session's, and Session.fit's on each Keras backend; and FUZZ_ELASTIC torch cases with an
# elastic kill, a job each), seeded by FUZZ_SEED (default: the time; the seed is printed),
# each checked against one process and a ledger of the samples each rank trained. A failure
# prints a one-line reproducer.
FUZZ_CASES ?= 200
FUZZ_ELASTIC ?= 5
FUZZ_SEED ?= $(shell date +%s)
fuzz: setup engines
	HVDKIT_SCENARIOS=$(FUZZ_CASES) HVDKIT_SCENARIO_SEED=$(FUZZ_SEED) HVDKIT_SCENARIO_WORKERS=1 \
	  HVDKIT_ELASTIC_SCENARIOS=$(FUZZ_ELASTIC) $(BIN)/python -m pytest -s \
	  tests/test_torch_scenarios.py tests/test_keras_scenarios.py -k generated $(PYTEST_ARGS)

# The compatibility matrix (tests/matrix.py): fresh venvs per cell, as a user installs;
# MATRIX_ARGS="--cells py312-tf221" picks cells, "--list" lists them.
MATRIX_ARGS ?=
matrix: setup
	$(BIN)/python tests/matrix.py $(MATRIX_ARGS)

# How much of each test file's time is process start and framework imports
# (tests/startup_cost.py): the suite (or PYTEST_ARGS) with every Python process logging both.
startup-cost: setup engines docs-deps
	$(BIN)/python tests/startup_cost.py -- $(PYTEST_ARGS)

# The profile's timing-derived verdicts with every core busy (tests/under_load.py): the profile
# tests PROFILE_RUNS times beside one spinning process per core; each run's lead is printed.
PROFILE_RUNS ?= 5
profile-under-load: setup
	$(BIN)/python tests/under_load.py --runs $(PROFILE_RUNS) -- $(BIN)/python -m pytest -q -s \
		-p no:cacheprovider tests/test_profile.py

# The GPU image (docker/Dockerfile.gpu) built here with podman or Docker and checked without
# a GPU; left out of CI for time (docs/guides/docker.md).
image-gpu: setup
	HVDKIT_TEST_ALL=1 $(BIN)/python -m pytest -s tests/test_docker_image.py -m gpu_image $(PYTEST_ARGS)

# The GPU checks (tests/gpu_checks.py) on a machine with an NVIDIA GPU, in the environment
# whose CUDA torch you train with (GPU_PYTHON): builds Horovod with NCCL, then without, and
# writes gpu-report/. Not in CI (no GPU there); docs/guides/gpus.md, "What has run on a GPU".
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) tests/gpu_checks.py --out gpu-report $(GPU_CHECK_ARGS)

engines: setup $(ENGINES_STAMP)

$(ENGINES_STAMP): $(ENGINES_STACK)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r $(ENGINES_STACK)
	touch $(ENGINES_STAMP)

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link, a page missing from
# the nav or an unresolved API reference fails the build. The reference reads hvdkit's and
# Horovod's sources (it imports only the CLI's parser), and fails without Horovod installed.
docs: setup docs-deps
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-deps: $(STAMP) $(DOCS_STAMP)

$(DOCS_STAMP): $(DOCS_STACK)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r $(DOCS_STACK)
	touch $(DOCS_STAMP)

# The docs site's pictures, each from a real run on this machine (dated in the pages that show
# them): the profile of examples/pytorch_slow_input.py before and after loader workers, the
# bench's bus-bandwidth, scaling and memory plots, the allreduce tutorial's cost-model plot. Minutes;
# not in CI (the pages' figures are checked to be dated, the PNGs to exist).
FIGURES := docs/images
FIGURES_TMP := build/figures
docs-figures: setup
	rm -rf $(FIGURES_TMP) && mkdir -p $(FIGURES) $(FIGURES_TMP)
	$(BIN)/hvdkit run -np 2 --gloo --profile $(FIGURES_TMP)/before -- $(BIN)/python \
	  examples/pytorch_slow_input.py --workers 0
	$(BIN)/hvdkit run -np 2 --gloo --profile $(FIGURES_TMP)/after -- $(BIN)/python \
	  examples/pytorch_slow_input.py --workers 2
	cp $(FIGURES_TMP)/before/profile.png $(FIGURES)/profile-slow-input-before.png
	cp $(FIGURES_TMP)/after/profile.png $(FIGURES)/profile-slow-input-after.png
	for backend in torch tensorflow; do KERAS_BACKEND=$$backend $(BIN)/hvdkit run -np 2 --gloo \
	  --profile $(FIGURES_TMP)/keras-$$backend -- $(BIN)/python tests/workers/profile_worker.py \
	  keras-fit && cp $(FIGURES_TMP)/keras-$$backend/profile.png \
	  $(FIGURES)/profile-keras-$$backend.png || exit 1; done
	$(BIN)/hvdkit bench --quick --only allreduce,training --no-progress --plots $(FIGURES_TMP)/bench
	cp $(FIGURES_TMP)/bench/allreduce_busbw.png $(FIGURES_TMP)/bench/throughput_vs_ranks.png $(FIGURES)/
	$(BIN)/hvdkit bench --only memory --no-progress --plots $(FIGURES_TMP)/memory
	cp $(FIGURES_TMP)/memory/memory.png $(FIGURES)/
	$(BIN)/hvdkit run --mpi -np 2 --hostfile hostfiles/localhost -- $(BIN)/python \
	  examples/allreduce_from_scratch.py --out $(FIGURES_TMP)/allreduce
	cp $(FIGURES_TMP)/allreduce/allreduce_from_scratch_N2.png $(FIGURES)/

# The built site in a real browser (Debian's chromium, installed when missing and root): every
# page renders with the whole navigation, search answers; screenshots in $(DOCS_CHECK_OUT)/.
docs-check: docs
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get install -y -q --no-install-recommends chromium; } || { \
	  echo "error: docs-check needs chromium. Fix: sudo apt-get install chromium"; exit 1; }
	$(BIN)/python tests/docs_check.py --site site --out $(DOCS_CHECK_OUT)

# ruff (style, imports, bugs) and mypy (types) over the package; settings in pyproject.toml.
lint: setup $(LINT_STAMP)
	$(BIN)/ruff check hvdkit
	$(BIN)/ruff format --check hvdkit
	$(BIN)/mypy hvdkit

$(LINT_STAMP): Makefile
	$(BIN)/python -m pip install -q --disable-pip-version-check $(LINT_TOOLS)
	touch $(LINT_STAMP)

sweep: setup
	$(BIN)/python tests/sweep.py --runs $(SWEEP_RUNS) --load $(SWEEP_LOAD) -- $(SWEEP_ARGS)

doctor: setup
	$(BIN)/hvdkit doctor

clean:
	rm -rf $(VENV) build *.egg-info site
