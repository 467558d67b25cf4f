PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# laplace-torch and the packages it imports, except backpack-for-pytorch (see docs/laplace.md)
LAPLACE_PACKAGES := laplace-torch==0.3 curvlinops-for-pytorch==3.0.1 asdfghjkl==0.1a4 \
	torchmetrics lightning-utilities einops einconv linear_operator opt-einsum

.PHONY: install demo test test-slow test-clients install-clients lint bench clean docs

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	# laplace-torch for tests/test_laplace.py, without its dependency on the original BackPACK
	$(BIN)/python -m pip install -q --no-deps $(LAPLACE_PACKAGES)
	-$(BIN)/python -m pip uninstall -q -y backpack-for-pytorch
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m backpack

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# Client libraries built on the original BackPACK, run on this one. `make install-clients` puts
# them in the venv *without* their dependency backpack-for-pytorch (which would shadow this
# package); without them, the tests of `make test-clients` are skipped.
CLIENT_PACKAGES := laplace-torch curvlinops-for-pytorch cockpit-for-pytorch
CLIENT_DEPS := asdfghjkl==0.1a4 scipy tqdm opt-einsum torchmetrics lightning-utilities einops \
	einconv linear_operator jaxtyping wadler-lindig mpmath json-tricks pandas seaborn

install-clients: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(CLIENT_PACKAGES) $(CLIENT_DEPS)
	-$(BIN)/python -m pip uninstall -q -y backpack-for-pytorch

test-clients: $(STAMP)
	$(BIN)/python -m pytest -q -m clients tests/clients $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# --- bench (benchmarks/, see benchmarks/README.md) -------------------------------------------
BENCH_ARGS ?=

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)
# --- end bench --------------------------------------------------------------------------------

# --- docs (docs/, mkdocs.yml, requirements-docs.txt) ----------------------------------------
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(BIN)/python -m pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site
# --- end docs ---------------------------------------------------------------------------------

# --- install-bench (benchmarks/requirements-bench.txt: peers for the comparisons) -----------
BENCH_VENV := .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin

install-bench:
	test -x $(BENCH_BIN)/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BENCH_BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BENCH_BIN)/python -m pip install -q -r benchmarks/requirements-bench.txt
	# curvlinops depends on the original BackPACK, whose `backpack` would shadow this package
	-$(BENCH_BIN)/python -m pip uninstall -q -y backpack-for-pytorch
	$(BENCH_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
.PHONY: install-bench
# --- end install-bench ------------------------------------------------------------------------
