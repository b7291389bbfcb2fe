# Set-up is part of every target: `make demo` and `make test` create (or reuse) .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On a CPU-only machine this pin resolves to the local CPU wheel; override for CUDA builds.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint bench gpu-check gpu-wheels clean

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

# On a CUDA machine: the tests marked gpu, the Megatron-Core loop and the GPU benchmark, one JSON
# (benchmarks/gpu_check.json; benchmarks/gpu_check.py says what each section measures). It runs with that machine's
# own python3 and its CUDA torch, not .venv (whose pinned torch is the CPU wheel): the project is installed there
# (editable, without dependencies), after the wheels in .whl/ if there are any, for a machine without a registry.
# Before and after in one call: `python benchmarks/gpu_check.py --prepare-before COMMIT` here (it reads the git
# history) writes build/gpu_before/atlas_tracking_COMMIT; carry build/gpu_before and pass
# GPU_ARGS="--before build/gpu_before/atlas_tracking_COMMIT" (the realistic section times both gates).
GPU_OUT ?= benchmarks/gpu_check.json
GPU_ARGS ?=
GPU_WHEELS := transformers tokenizers megatron-core threadpoolctl
gpu-check:
	$(PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation $(wildcard .whl/*.whl) -e .
	$(PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)

# The wheels gpu-check installs on a machine without a registry (Python 3.12, x86-64), at constraints.txt's versions.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$(foreach p,$(GPU_WHEELS),$(shell grep -i '^$(p)==' constraints.txt))

clean:
	rm -rf $(VENV) build site *.egg-info
