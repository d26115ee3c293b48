# `make demo` and `make test` bootstrap everything they need on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
ENGINE_VENV ?= .venv-engine
export PDSERVE_ENGINE_PYTHON ?= $(abspath $(ENGINE_VENV))/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap venv engine-venv model demo test unit e2e lint typecheck image image-test clean

bootstrap: venv engine-venv model

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(VENV)/bin/pip install -q -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(VENV)/bin/python -c "import pdserve, aiohttp, uvloop, openai"
	touch $@

engine-venv: $(ENGINE_VENV)/.installed
$(ENGINE_VENV)/.installed: scripts/engine-venv.sh
	bash scripts/engine-venv.sh $(ENGINE_VENV)
	touch $@

# The default model (SmolLM2-135M-Instruct) and the tiny random one the tests use, built once into
# ~/.cache/pdserve (or $PDSERVE_CACHE_DIR).
model: venv engine-venv
	$(VENV)/bin/pdserve model
	$(VENV)/bin/pdserve model --model tiny

demo: bootstrap
	$(VENV)/bin/pdserve demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy

# pytest's exit code 5 ("no tests collected") is a failure here, and so is any skipped test
# (PDSERVE_FORBID_SKIPS): a suite that skips its real-vLLM tests proves nothing.
test: bootstrap lint typecheck
	PDSERVE_FORBID_SKIPS=1 $(VENV)/bin/pytest -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

unit: venv
	$(VENV)/bin/pytest -m "not vllm" $(PYTEST_ARGS)

e2e: bootstrap
	PDSERVE_FORBID_SKIPS=1 $(VENV)/bin/pytest -m vllm -ra $(PYTEST_ARGS)

# The proxy's container image, pdserve:<version> (Dockerfile), with podman or docker: whichever works here,
# else podman installed with apt-get; the base is python:3.12-slim, or a Debian one made here if it cannot be
# pulled (scripts/image.sh). Prints the image's name:tag and digest.
image:
	bash scripts/image.sh build

# The image in front of a real vLLM pair: k8s render's arguments accepted, `pdserve verify` through it,
# SIGTERM mid-stream drains (scripts/image-test.sh).
image-test: image venv engine-venv
	bash scripts/image-test.sh

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(ENGINE_VENV).install.log runs .pytest_cache .mypy_cache .ruff_cache
