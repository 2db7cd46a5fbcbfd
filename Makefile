# Two commands a new user needs:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade --quiet pip
	$(VPY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

demo: venv
	$(VPY) scripts/demo.py

test: venv
	$(VPY) -m pytest -q tests

clean:
	rm -rf demo_out .pytest_cache
