# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo flops clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependencies change.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	@echo "make demo: not yet -- the training loop (issue 4) has not landed; 'make test' and 'make flops' work."

flops: $(STAMP)
	$(PY) -m lipsformer.flops

clean:
	rm -rf $(VENV) .pytest_cache
