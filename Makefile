# The README's two commands: `make run` (start the appliance on :9100) and `make test`.
SHELL := /bin/bash
VENV := $(shell scripts/venv-dir.sh)
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Loopback only by default; `make run HOST=0.0.0.0` exposes the server (set SANDBOX_AUTH_TOKEN first).
HOST ?= 127.0.0.1
PORT ?= 9100
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: the suite mostly waits (jails and servers starting), so
# more workers than cores (6 were measured no faster than 4 on 2 cores: 538 s against 492 s); a
# module stays on one worker (its server starts once) and tests marked `exclusive` run alone
# (tests/exclusive.py). Modules are handed out in tests/conftest.py's order (`schedule_order`:
# slow ones first), which --no-loadscope-reorder keeps. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4

JS_SDK := tests/js/e2b

.PHONY: setup system venv js cuda-build cuda-wheel run test test-fast lint check bench audit gpu-kit gpu-rehearsal clean

setup: system venv js

system:
	@scripts/setup-system.sh

# APPLIANCE_CUDA_BUILD=1 asks for the CUDA build of llama.cpp here too, on a venv that is
# already installed (.installed is up to date then, and would not run again).
venv: $(VENV)/.installed
	@if [ "$${APPLIANCE_CUDA_BUILD:-0}" = 1 ]; then scripts/cuda-build.sh $(PY); fi

# Debian's /usr/bin/python3: a pyenv python in root's 0700 home cannot run as uid 1001.
# cuda-build.sh here only says how to ask for the CUDA build where nvcc is present.
$(VENV)/.installed: pyproject.toml client/pyproject.toml tests/requirements-nodeps.txt
	@if [ ! -x $(PY) ]; then $(SUDO) mkdir -p $(dir $(VENV)) && $(SUDO) chown "$$(id -u)" $(dir $(VENV)) 2>/dev/null; /usr/bin/python3 -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[science,test,gpu,bench]'
	$(PY) -m pip install -q --no-deps -r tests/requirements-nodeps.txt   # pinned; why: the file's comments
	$(PY) -m pip install -q -e './client[mcp]'   # the client distribution (client/pyproject.toml)
	@APPLIANCE_CUDA_BUILD=0 scripts/cuda-build.sh $(PY)
	@touch $@

# The E2B JavaScript SDK that tests/test_e2b_js.py runs, and the node it runs under, exactly as
# the lockfile pins them (npm ci), into the gitignored $(JS_SDK)/node_modules; again only when
# package.json or the lockfile change.
js: $(JS_SDK)/node_modules/.installed

$(JS_SDK)/node_modules/.installed: $(JS_SDK)/package.json $(JS_SDK)/package-lock.json
	cd $(JS_SDK) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# llama-cpp-python rebuilt for CUDA in the venv (needs nvcc; many minutes; docs/gpu.md).
cuda-build: $(VENV)/.installed
	APPLIANCE_CUDA_BUILD=1 scripts/cuda-build.sh $(PY)

# Every SANDBOX_* setting (from the environment or `make run SANDBOX_X=...`) reaches the server:
# sudo's env_reset would drop them, so scripts/serve.sh passes each as an `env NAME=value` argument.
run: setup
	SUDO="$(SUDO)" scripts/serve.sh $(VENV) --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The fast tier (tests/tiers.py): no server, no jail, no firejail, no root; the venv must exist
# (`make setup` once). Any user may run it.
test-fast:
	$(PY) -m pytest -m fast -p no:cacheprovider $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check appliance client tests benchmarks examples security
	$(VENV)/bin/ruff format --check appliance client tests benchmarks examples security
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports   # the layer contracts (pyproject.toml, [tool.importlinter])
	scripts/actionlint.sh $(VENV)   # .github/workflows (gpu.yml)

check: lint test

bench: setup
	$(PY) -m benchmarks
	$(PY) -m benchmarks.inference
	$(PY) -m benchmarks.cgroups

# The adversarial suite, and its report in security/ (make test runs the attacks, writes nothing).
audit: setup
	$(PY) -m security.audit

# The CUDA build of llama-cpp-python the kit carries, built once with nvcc into the cache
# build/cuda-wheel/ (sm_90: H100/H200; CUDA_ARCHS="80;89;90" for more; long on 2 cores).
cuda-wheel: venv
	nice -n 10 scripts/cuda-wheel.sh $(PY) build/cuda-wheel

# The offline real-GPU acceptance kit: build/gpu-kit/ and build/gpu-kit.tar.gz, at most 64 MiB
# (docs/gpu.md, "The acceptance kit"); on the GPU machine, as root:
#   tar xzf gpu-kit.tar.gz -C /opt && /opt/gpu-kit/gpu-acceptance.sh
gpu-kit: venv
	PY=$(PY) scripts/gpu-kit.sh build/gpu-kit

# That command, rehearsed in a bare Debian root with a simulated GPU (tests/test_gpu_kit.py runs it).
gpu-rehearsal: gpu-kit
	PY=$(PY) scripts/gpu-rehearsal.sh build/gpu-kit.tar.gz build/gpu-rehearsal

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
