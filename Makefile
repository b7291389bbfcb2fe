# Set-up is part of every target: `make demo` and `make test` create (or reuse) .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a CPU-only machine this pin resolves to the local CPU wheel; override for CUDA builds.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,dev]" -c constraints.txt
	# LitGPT pins huggingface-hub<1.4 and jsonargparse<=4.41 (transformers 5 and LightningCLI need newer ones);
	# its model code needs only torch and lightning, so it is installed without its dependencies.
	$(BIN)/python -m pip install -q --no-deps "litgpt==0.5.13"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The documentation site (docs/, MkDocs): strict, so a broken link or anchor fails; the reference tables are
# generated from the code at every build (docs/hooks.py). `make test` builds it too (tests/unit/test_docs_site.py).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build site *.egg-info
