# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-floors test-triton demo finetune-demo flops clean gpu-wheels gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependencies change. uv fetches and unpacks the several GB of a CUDA build of torch in parallel,
# several times faster than pip (docs/README.md, the suite's own time); pip installs if uv cannot.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip uv
	$(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) -e ".[dev]" || $(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# pytest in TEST_WORKERS processes (pytest-xdist), one test file each at a time, each worker's torch on one thread:
# two workers' torch threads on two cores contend, one each keeps both cores busy through the seconds a test spends
# starting processes and reading files (docs/README.md, the suite's own time).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The oldest versions pyproject.toml allows, in a venv of their own, on the suite's fast subset (not part of CI,
# which tests what pip resolves today): every test not marked slow (pyproject.toml's markers), the shipped recipes
# among them; a new test joins it unless it is marked. torch 2.9.1 brings Triton 3.5.1, whose interpreter (the fused
# kernels' tests) turns one-element arrays into scalars, which numpy 2.4 refuses: numpy below 2.4 there. setuptools
# 68 or later, which benchmarks/gpu.sh needs to install the project (a venv of Python 3.11 starts with 65).
FLOORS := torch==2.9.1 torchvision==0.24.1 timm==1.0.31 accelerate==1.15.0 pillow==10.0.0 "numpy<2.4"
FLOORS_VENV := .venv-floors
FLOORS_MARKS := not slow and not gpu
test-floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --upgrade pip "setuptools>=68"
	$(FLOORS_VENV)/bin/python -m pip install --quiet -e ".[dev]" $(FLOORS)
	$(FLOORS_VENV)/bin/python -c "import torch, torchvision, timm, accelerate, PIL; print('floors:', torch.__version__, \
		torchvision.__version__, timm.__version__, accelerate.__version__, PIL.__version__)"
	$(FLOORS_VENV)/bin/python -m pytest -q -m "$(FLOORS_MARKS)"

# The fused ops' Triton kernels under each Triton from the torch floor's (2.9: Triton 3.5.1) to the one before
# today's (not part of CI, which tests today's): the kernel tests under that Triton's interpreter and the sm_90 compile
# check (tests/test_fused.py), with it first on the path from .triton/VERSION; numpy below 2.4 for the interpreters
# before Triton 3.7 (as in test-floors).
TRITONS := 3.5.1 3.6.0 3.7.1 3.8.0
test-triton: $(STAMP)
	set -e; for v in $(TRITONS); do \
		$(PY) -m pip install --quiet --no-deps --upgrade --target .triton/$$v triton==$$v "numpy<2.4"; \
		echo "triton $$v"; \
		PYTHONPATH=.triton/$$v $(PY) -m pytest -q -p no:cacheprovider tests/test_fused.py -k "interpreter or compiles"; \
	done

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
	rm -rf $(VENV) $(FLOORS_VENV) .triton .pytest_cache

# A GPU machine without a package registry (README GPU): `make gpu-wheels` here, where pip reaches PyPI, fills .whl/
# with the wheels such a machine lacks (CUDA torch 2.11, torchvision, accelerate 1.15, timm and pytest are there;
# fvcore and its small dependencies and pytest-xdist are not; timm and pytest-timeout are fallbacks should its own be
# older than our floors). fvcore and iopath publish no wheels, so pip builds them (pure Python). Then, on the GPU
# machine: `make gpu-check`.
GPU_WHEEL_PLATFORM := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: $(GPU_WHEEL_PLATFORM) -d .whl \
		timm==1.0.31 yacs==0.1.8 termcolor==3.3.0 pytest-xdist==3.8.0 execnet==2.1.2 pytest-timeout==2.4.0
	$(PYTHON) -m pip wheel --quiet --no-deps --no-build-isolation -w .whl fvcore==0.1.5.post20221221 iopath==0.1.10
	ls .whl

gpu-check:  # make gpu-check GPU_ARGS="--released /path/to/LipsFormer"
	bash benchmarks/gpu.sh $(GPU_ARGS)
