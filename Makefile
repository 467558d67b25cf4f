PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# laplace-torch and the packages it imports, except backpack-for-pytorch (see docs/laplace.md)
LAPLACE_PACKAGES := laplace-torch==0.3 curvlinops-for-pytorch==3.0.1 asdfghjkl==0.1a4 \
	torchmetrics lightning-utilities einops einconv linear_operator opt-einsum

.PHONY: install demo test test-slow test-clients install-clients lint bench clean docs

# torch and torchvision: the venv's own are kept when torch >= 2.4 imports with a torchvision
# built for it (tools/torch_check.py says which, and pins them for the rest of the install);
# otherwise, or with PIN_TORCH=1 (as .ci/run does), the pinned ones of requirements-torch.txt.
# `make demo` needs no torchvision and keeps any torch >= 2.4.
PIN_TORCH ?=
TORCH_CONSTRAINTS := $(VENV)/torch-constraints.txt
TORCH_INPUTS := requirements-torch.txt tools/torch_check.py

# $(call keep_or_pin_torch,CHECK_OPTIONS)
define keep_or_pin_torch
@if [ -n "$(PIN_TORCH)" ] || ! $(BIN)/python tools/torch_check.py $(1) $(TORCH_CONSTRAINTS); then \
	echo "$(BIN)/python -m pip install -q -r requirements-torch.txt"; \
	$(BIN)/python -m pip install -q -r requirements-torch.txt && \
	$(BIN)/python tools/torch_check.py $(1) $(TORCH_CONSTRAINTS); \
fi
endef

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml requirements-dev.txt $(TORCH_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(call keep_or_pin_torch,)
	$(BIN)/python -m pip install -q -r requirements-dev.txt -c $(TORCH_CONSTRAINTS)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	# laplace-torch for tests/test_laplace.py, without its dependency on the original BackPACK
	$(BIN)/python -m pip install -q --no-deps $(LAPLACE_PACKAGES)
	-$(BIN)/python -m pip uninstall -q -y backpack-for-pytorch
	touch $(STAMP)

install: $(STAMP)

# the tour needs only the package and matplotlib, not the test requirements
DEMO_STAMP := $(VENV)/.demo-stamp

$(DEMO_STAMP): pyproject.toml $(TORCH_INPUTS) | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(call keep_or_pin_torch,--torch-only)
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[plot]" -c $(TORCH_CONSTRAINTS)
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
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
	$(BENCH_BIN)/python -m pip install -q -r requirements-torch.txt
	$(BENCH_BIN)/python -m pip install -q -r benchmarks/requirements-bench.txt
	# curvlinops depends on the original BackPACK, whose `backpack` would shadow this package
	-$(BENCH_BIN)/python -m pip uninstall -q -y backpack-for-pytorch
	$(BENCH_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
.PHONY: install-bench
# --- end install-bench ------------------------------------------------------------------------
