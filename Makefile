# One command each: `make demo` (set up, then run the local cluster) and `make test` (set up, then run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; installed before the project so pip does not pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test compose-demo
setup: $(VENV)/.installed

# recbole is installed with --no-deps for the MovieLens-100k file its wheel ships (trainer/recdata.py reads the
# file and never imports recbole, so its own dependency tree is left out). The Makefile is a prerequisite so that
# an existing .venv picks up a new install line.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps recbole==1.2.1
	touch $@

demo: setup
	$(VENV)/bin/ps-cluster $(ARGS)

# pytest exits 5 when it collected no tests: treat that as a failure, not a pass.
test: setup
	$(PY) -m pytest -q $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

# The compose demo in real containers on this machine, built without a registry (deploy/compose_demo.py):
# `make compose-demo`, or `make compose-demo ARGS=--kill-shard` to SIGKILL a shard mid-run. Needs root.
compose-demo:
	python3 deploy/compose_demo.py $(ARGS)
