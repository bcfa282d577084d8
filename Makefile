# lm-zoo: `make test` (set up .venv and run the tests; `make quick` without the slow ones), `make demo` (train, evaluate and sample a small model),
# `make verify-pretrained` (re-measure every registered pretrained figure at its own eval batch size; CI runs it),
# `make docs` (render the README's and docs/' tables from the registry and benchmarks/results/).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
DEMO := runs/demo
# The demo's run keeps its checkpoints in its own version folder, as every recipe's run does (none sets
# checkpoint.dirpath); `make demo` empties runs/demo first, so its run is version_0.
DEMO_CKPT := $(DEMO)/lightning_logs/version_0/checkpoints/best.ckpt

.PHONY: setup quick test verify-pretrained docs demo publish-pretrained clean

setup: $(VENV)/.installed

# torch first, pinned, so that installing lm-zoo (which asks only for torch>=2.6) keeps the build chosen here. From PyPI,
# torch 2.13.0 on Linux is the CUDA build (several GB of CUDA libraries); TORCH_INDEX names another wheel index, as
# pytorch.org/get-started does for the CPU-only build: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

# The quick lane while working: every module's quick tests (the verify_pretrained ones are slow too).
# Both lanes run on PYTEST_WORKERS pytest-xdist workers, one per core (one torch thread each; the tests that start
# several processes share one worker: tests/conftest.py, PROCESS_MODULES); PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)
quick: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

# The registered figures themselves (the whole test split, most at eval batch 1); `make test` re-measures each model's
# check figure (the split's first windows) instead.
verify-pretrained: setup
	$(BIN)/python -m pytest -q -m verify_pretrained

docs: setup
	$(BIN)/python -m release table
	$(BIN)/python benchmarks/render.py

demo: setup
	rm -rf $(DEMO)
	$(BIN)/lm-zoo fit --config configs/synthetic/xml-lstm.yaml
	$(BIN)/lm-zoo evaluate $(DEMO_CKPT) --split test
	$(BIN)/lm-zoo generate $(DEMO_CKPT) --num-samples 5 --temperature 0.7 --seed 1
	@$(BIN)/python -c "import checkpoints; from release.bundle import xml_nesting; \
	r = xml_nesting(checkpoints.load('$(DEMO_CKPT)')); \
	print(f\"closing tags that close the innermost open tag: {r['fraction']:.0%} of {r['closing_tags']} in {r['samples']} sampled documents\")"
	@echo "and a word model lm-zoo ships (pretrained/ptb-lstm-small, trained on Penn Treebank):"
	$(BIN)/lm-zoo generate ptb-lstm-small --prompt "the stock market" --num-samples 3 --max-tokens 30 --seed 1

# Maintainers: every bundled model (pretrained/) to its registered Hub repo id, tagged with its revision. Needs HF_TOKEN.
publish-pretrained: setup
	$(BIN)/python -m release publish

clean:
	rm -rf $(VENV) runs
