# Everything a fresh machine needs: `make test` and `make serve` set up the venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2

.PHONY: install test test-fast serve bench clean

# The editable install also compiles the native kernels (csrc/, three CPU variants): rebuild on change.
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/tokenmill pull $(MODEL)
	$(BIN)/tokenmill pull gemma3:270m
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

serve: install
	$(BIN)/tokenmill serve $(MODEL)

bench: install
	$(BIN)/python bench/single_stream.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache src/tokenmill/_native_*.so
