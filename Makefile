# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv on first use; torch is pinned here (a CPU wheel) and only lower-bounded
# in the package metadata, so that pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.stepskip-installed
# verl 0.9.1's own environment (tensordict 0.10), used only to prove that verl loads what
# `format: verl` writes; `make test VERL_ENV=0` skips building it (those tests then skip).
VERL_ENV ?= 1
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
TEST_DEPS := $(STAMP)
ifeq ($(VERL_ENV),1)
TEST_DEPS += $(VERL_STAMP)
endif
# The browser tests of `stepskip view` drive Debian's headless chromium; `make test BROWSER=0` skips
# installing it (those tests then install it themselves when they can, else skip with the reason).
BROWSER ?= 1
ifeq ($(BROWSER),1)
TEST_DEPS += browser
endif

.PHONY: demo test typecheck venv verl-env browser clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,hydra,tq,s3,pipelines]"
	touch $(STAMP)

$(VERL_STAMP):
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install --quiet $(TORCH_PIN)
	$(VERL_VENV)/bin/pip install --quiet --no-deps verl==0.9.1 tensordict==0.10.0
	$(VERL_VENV)/bin/pip install --quiet numpy packaging cloudpickle importlib_metadata orjson \
		"pyvers>=0.1.0,<0.2.0" ray==2.60.0 omegaconf==2.3.1 "transformers>=5.5.3,<5.11,!=5.6.0"
	$(VERL_VENV)/bin/python -c "from verl.protocol import DataProto"
	touch $(VERL_STAMP)

venv: $(STAMP)

verl-env: $(VERL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/stepskip demo

# mypy over src/stepskip with pyproject's [tool.mypy]; `make test` fails on a type error too.
typecheck: $(STAMP)
	$(PY) -m mypy

browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "chromium is missing and cannot be installed here: the browser tests will skip"; fi; }

test: $(TEST_DEPS) typecheck
	STEPSKIP_VERL_PYTHON=$(abspath $(VERL_VENV))/bin/python $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) build dist src/*.egg-info .pytest_cache .mypy_cache
