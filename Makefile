# Two commands a new user needs:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PIP_VERSION := 26.3
STEPS ?=
LONG ?=

.PHONY: demo test test-gpu gpu-report gpu-wheels venv venv-dev lock-check bench clean

# Two pinned locks (scripts/lock_requirements.py writes them): requirements.txt is what the demo and the pipeline
# need (~1.5 GB with torch, a minute or more the first time), requirements-dev.txt adds the tests and every optional
# extra a test covers. pip shows its progress: the first run is long and should not look hung.
venv: $(STAMP)
venv-dev: $(DEV_STAMP)

$(STAMP): requirements.txt
	@test -x $(VPY) || { echo "make: creating $(VENV) (first run: installing PyTorch and the pinned requirements, ~1.5 GB)"; $(PY) -m venv $(VENV); }
	$(VPY) -m pip install --disable-pip-version-check --progress-bar on pip==$(PIP_VERSION)
	$(VPY) -m pip install --disable-pip-version-check --progress-bar on -r requirements.txt
	touch $(STAMP)

# requirements-peers.txt: the peer frameworks the benches compare with, exact and --no-deps (its header says why)
$(DEV_STAMP): $(STAMP) requirements-dev.txt requirements-peers.txt
	$(VPY) -m pip install --disable-pip-version-check --progress-bar on -r requirements-dev.txt
	$(VPY) -m pip install --disable-pip-version-check --progress-bar on --no-deps -r requirements-peers.txt
	touch $(DEV_STAMP)

# the locks are what the venv holds (run after editing a .in file and reinstalling; see the script)
lock-check: venv-dev
	$(VPY) scripts/lock_requirements.py --check

# `make demo`: 300 training steps (a few minutes on 2 cores); `make demo LONG=1`: 800; `make demo STEPS=50`: any.
# demo_out/ is kept: the same command continues after a Ctrl-C (`make clean` starts over). `exec`: the demo
# itself answers a Ctrl-C (one line saying how to continue), not the shell make starts.
demo: venv
	exec env DEMO_UNDER_MAKE=1 STEPS="$(STEPS)" LONG="$(LONG)" $(VPY) scripts/demo.py

# the suite on every core (pytest-xdist), each test file's tests shared out as workers free up. One worker more
# than cores (at most 8): many tests spend seconds waiting on other processes (monitor timeouts, ranks, a
# compile subprocess), and a third worker on 2 cores fills that idle time (fresh clone, 2 cores: 625 s of
# pytest with 2 workers, 562 s with 3; CPU idle during the 3-worker run: 1%).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(8, (os.cpu_count() or 1) + 1))")
test: venv-dev
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

# on a CUDA machine: kernel numerics at real sizes, bf16 steps per kernel, compile with zero graph breaks, the trainer
test-gpu: venv-dev
	MYLLM_FAILURES_NOW=1 $(VPY) -m pytest -q -m gpu tests

# on a CUDA machine: the verdict in one report, out/gpu_report/report.md, in <= 9 min on one H100: GPU tests,
# the benchmark rows that decide the goals (124m, 1b), the trainer eager and compiled, a profile of the compiled
# step; `make gpu-report PART=tests|bench|train|profile` runs one part and merges it into the report.
# Without CUDA it says so in one line and exits 0. No venv/pip step: it runs with .venv's python when there is one, else python3 (a GPU machine's own torch).
gpu-report:
	@$(if $(wildcard $(VPY)),$(VPY),$(PY)) scripts/gpu_report.py $(if $(PART),--only $(PART))

# here, with pip's registry: the extras the GPU machine's image lacks (requirements-gpu.txt: FlashAttention-4,
# torchtitan, Liger-Kernel) as cp312 wheels in .whl/ (ignored), the large ones repacked to fit the device tool's
# 64 MiB carry; `gpu-report` installs them first there (docs/benchmarks.md "Carrying the extras").
gpu-wheels:
	$(if $(wildcard $(VPY)),$(VPY),$(PY)) scripts/gpu_wheels.py download --dest .whl

clean:
	rm -rf demo_out .pytest_cache
