# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo finetune-demo flops clean

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

# The digits demo: written once as an image folder, trained from scratch (its output folder is replaced),
# then its last weights evaluated by eval.py.
demo: $(STAMP)
	$(PY) -m lipsformer.data.digits output/digits
	rm -rf output/demo_digits
	$(PY) train.py --config configs/demo_digits.yaml
	$(PY) eval.py --checkpoint output/demo_digits --data-dir output/digits --output output/demo_digits/eval.json

# The transfer demo: pretrain on digits 0-4, fine-tune on digits 5-9 from 10 labels per class (fine-tune vs
# scratch vs linear probe; 32 px weights fine-tuned at 64 px); output/transfer/transfer.json and a table.
finetune-demo: $(STAMP)
	$(PY) benchmarks/transfer.py

flops: $(STAMP)
	$(PY) -m lipsformer.flops

clean:
	rm -rf $(VENV) .pytest_cache
