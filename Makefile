# Everything a fresh machine needs: `make test` and `make serve` set up the venv themselves.
# `make serve` installs what serving needs; `make test` adds the test tools (Ray, schemathesis,
# transformers, hypothesis, ...) on top, without building the package again.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP  := $(VENV)/.installed-test
OLD_STAMP   := $(VENV)/.installed
MODEL  ?= smollm2

.PHONY: install install-test test test-fast serve bench clean

# The editable install also compiles the native kernels (csrc/, three CPU variants): rebuild on change.
# torch goes first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
# A venv set up before serve and test were split has one stamp (.installed) for the whole test
# install: while it is newer than everything the install depends on, it stands for both.
$(SERVE_STAMP): pyproject.toml setup.py $(wildcard csrc/*)
	@if [ -f $(OLD_STAMP) ] && [ -z "$$(find $^ -newer $(OLD_STAMP))" ]; then \
	    echo "$(OLD_STAMP) is up to date: the venv already has everything installed"; \
	else \
	    set -ex; \
	    $(PYTHON) -m venv $(VENV); \
	    $(BIN)/pip install -q torch==2.13.0; \
	    $(BIN)/pip install -q -e .; \
	fi
	touch $@

# The test extras alone, read from pyproject.toml: `pip install -e '.[test]'` would compile again.
$(TEST_STAMP): $(SERVE_STAMP) pyproject.toml
	$(BIN)/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test'], sep='\n')" > $(VENV)/test-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/test-requirements.txt
	touch $@

install: $(SERVE_STAMP)

install-test: $(TEST_STAMP)

test: install-test
	$(BIN)/tokenmill pull $(MODEL)
	$(BIN)/tokenmill pull gemma3:270m
	$(BIN)/python -m pytest -q -ra

test-fast: install-test
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

serve: install
	$(BIN)/tokenmill serve $(MODEL)

bench: install
	$(BIN)/python bench/single_stream.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache src/tokenmill/_native_*.so
