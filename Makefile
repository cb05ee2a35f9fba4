# The README's two commands: `make demo` (the main job) and `make test` (the test suite); `make docs`
# builds the docs site.
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

.PHONY: demo docs test test-unit-td010 typecheck venv verl-env browser clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,hydra,tq,s3,pipelines,trl,docs,trackers]"
	touch $(STAMP)

# What importing verl's trainers (RayPPOTrainer, the V1 PPOTrainerSync, the fully async
# agent loop) needs beyond verl's own pins, resolved under those pins (VERL_PINS); TransferQueue
# goes in without its deps (it would pull ray[default]'s dashboard stack), which are listed here.
VERL_PINS := tests/integration/verl_real/verl-pins.txt
VERL_TRAINER_DEPS := torchdata==0.11.0 hydra-core==1.3.8 codetiming==1.4.0 datasets==5.2.0 pillow==13.0.0 \
	peft==0.21.2 accelerate==1.15.0 cachetools==7.3.3 uvicorn==0.54.0 fastapi==0.165.0 aiohttp==3.14.5 \
	pandas==3.1.1 pyarrow==26.0.1 pyzmq==27.3.0 msgspec==0.23.0 psutil==7.2.2 prometheus_client==0.26.0
# The tracker backends verl's `trainer.logger` drives in the tracking tests (verl itself requires wandb
# and tensorboard); mlflow-skinny holds cachetools below 8, hence cachetools 7 above.
VERL_TRACKER_DEPS := tensorboard==2.21.0 wandb==0.31.0 mlflow-skinny==3.18.0
# stepskip's own runtime deps (stepskip itself is put on PYTHONPATH by the tests, not installed),
# and the test runner for the unit suite's tensordict-0.10 leg.
VERL_STEPSKIP_DEPS := safetensors==0.8.0 xxhash==4.1.0 zstandard==0.25.0 typer==0.29.2 rich==15.0.0 \
	pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 hypothesis==6.170.17
# The unit suite once more under verl's tensordict 0.10, in .venv-verl with verl hidden (the suite
# is written for an environment without verl): the tests whose code builds, encodes, decodes, moves or
# compares batches (TensorDict, DataProto, numpy columns), where verl's tensordict, torch and numpy pins
# can change what happens. Left to the main environment: configuration, the docs, the viewer's pages,
# the byte-level stores, logging and layout (nothing there touches a tensor library). Deselected: the
# two tests about the environment itself (verl absent, the console script installed), which this leg
# fakes or does not do.
UNIT_TD010_TESTS := tests/unit/formats tests/unit/tq tests/unit/roles tests/unit/manager tests/unit/integrations \
	tests/unit/worker tests/unit/compat tests/unit/cli tests/unit/test_batch.py tests/unit/test_compare.py \
	tests/unit/test_fidelity.py tests/unit/test_matching.py tests/unit/test_hint_documents.py \
	tests/unit/test_testing_helpers.py tests/unit/test_tracker.py
UNIT_TD010 := PYTHONPATH=$(abspath src):$(abspath tests/integration/verl_real/legs) \
	$(VERL_VENV)/bin/python -m pytest -q -p hide_verl $(UNIT_TD010_TESTS) \
	--deselect tests/unit/compat/test_verl_written_cache.py::test_verl_is_not_installed_here \
	--deselect tests/unit/cli/test_inspect.py::test_console_script_is_installed_and_lists_every_command

$(VERL_STAMP): $(VERL_PINS) Makefile
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install --quiet $(TORCH_PIN)
	$(VERL_VENV)/bin/pip install --quiet --no-deps verl==0.9.1 tensordict==0.10.0
	$(VERL_VENV)/bin/pip install --quiet numpy packaging cloudpickle importlib_metadata orjson \
		"pyvers>=0.1.0,<0.2.0" ray==2.60.0 omegaconf==2.3.1 "transformers>=5.5.3,<5.11,!=5.6.0"
	$(VERL_VENV)/bin/pip install --quiet -c $(VERL_PINS) $(VERL_TRAINER_DEPS) $(VERL_TRACKER_DEPS) $(VERL_STEPSKIP_DEPS)
	$(VERL_VENV)/bin/pip install --quiet --no-deps transferqueue==0.1.11
	$(VERL_VENV)/bin/python -c "from verl.protocol import DataProto"
	$(VERL_VENV)/bin/python -c "import verl.trainer.ppo.ray_trainer, verl.trainer.ppo.v1.trainer_sync, \
		verl.experimental.fully_async_policy.fully_async_rollouter, transfer_queue, hydra, xxhash, zstandard, \
		tensorboard, wandb, mlflow"
	touch $(VERL_STAMP)

venv: $(STAMP)

verl-env: $(VERL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/stepskip demo

# The docs site (mkdocs.yml) into site/, strictly: a broken link or a page missing from the nav fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# mypy over src/stepskip with pyproject's [tool.mypy]; `make test` fails on a type error too.
typecheck: $(STAMP)
	$(PY) -m mypy

browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "chromium is missing and cannot be installed here: the browser tests will skip"; fi; }

# Two legs side by side (tools/test_legs.sh: Ray's tests in one, mypy and everything else in the
# other); `make test PYTEST_ARGS=...` runs mypy, then pytest with those arguments alone.
ifeq ($(VERL_ENV),1)
LEGS_VERL := VERL_PY=$(abspath $(VERL_VENV))/bin/python UNIT_TD010='$(UNIT_TD010)'
endif
ifeq ($(strip $(PYTEST_ARGS)),)
test: $(TEST_DEPS)
	PY=$(PY) $(LEGS_VERL) tools/test_legs.sh
else
test: $(TEST_DEPS) typecheck
	STEPSKIP_VERL_PYTHON=$(abspath $(VERL_VENV))/bin/python $(PY) -m pytest -q $(PYTEST_ARGS)
endif

# Only the tensordict-0.10 leg of the unit suite.
test-unit-td010: $(VERL_STAMP)
	$(UNIT_TD010)

clean:
	rm -rf $(VENV) $(VERL_VENV) build dist site src/*.egg-info .pytest_cache .mypy_cache
