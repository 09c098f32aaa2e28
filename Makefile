# The two commands: `make demo` and `make test`. Both bootstrap .venv idempotently:
# the stamp file is rebuilt only when requirements.txt or setup.py change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pathways-installed

.PHONY: demo test bench proto clean-venv test-slurm

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) recipes/quickstart.py

# Two pytest processes, each taking whole test modules (a module shares one cluster):
# 876 s against 1,238 s in one process on 2 cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# Modules whose verdict needs the machine to themselves run after the others, alone:
# test_shares measures the programs each client completes, and with another module
# loading the 2 cores beside it shares 1:2:4:8 once completed 10:56:55:45.
ALONE := tests/test_shares.py

test: $(STAMP)
	rc=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ALONE:%=--ignore=%) tests || rc=$$?; \
	$(PY) -m pytest -q $(ALONE) || rc=$$?; \
	exit $$rc

BENCH_STAMP := $(VENV)/.pathways-bench-installed

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt
	touch $(BENCH_STAMP)

# Every benchmark, each against its baseline in the same run; writes bench/results.json
# and regenerates docs/evaluation.md with its plots (bench/report.py). 8-15 minutes on 2 cores.
bench: $(BENCH_STAMP)
	$(PY) bench/run_all.py

# A real Slurm 22.05 cluster of 4 emulated nodes on this machine (apt-get installs
# slurm-wlm and munge if missing), Pathways run on it through deploy/slurm/pathways.sbatch
# and TorchX's slurm scheduler, one run with a worker killed mid-training; writes
# bench/slurm.json. Needs root, changes /etc/hosts and /etc/slurm while it runs (restored
# at the end, also on failure): not part of `make test`. Several minutes.
test-slurm: $(STAMP)
	$(PY) tests/slurm/harness.py

# Regenerate the committed gRPC stubs from proto/pathways.proto.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Ipathways_torch/rpc=proto --python_out=. --grpc_python_out=. proto/pathways.proto

clean-venv:
	rm -rf $(VENV)
