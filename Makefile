# Two commands a new user needs:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STEPS ?= 800

.PHONY: demo test test-gpu venv bench clean

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade --quiet pip
	$(VPY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

# `make demo STEPS=50`: a short version (default 800 training steps)
demo: venv
	STEPS=$(STEPS) $(VPY) scripts/demo.py

test: venv
	$(VPY) -m pytest -q tests

# on a CUDA machine: kernel numerics at real sizes, bf16 steps per kernel, compile with zero graph breaks, the trainer
test-gpu: venv
	$(VPY) -m pytest -q -m gpu tests

clean:
	rm -rf demo_out .pytest_cache
