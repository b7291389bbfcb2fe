# Set-up is part of every target: `make demo` and `make test` create (or reuse) .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a CPU-only machine this pin resolves to the local CPU wheel; override for CUDA builds.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,dev]" -c constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
