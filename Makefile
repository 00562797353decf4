# make demo: venv, install, demo model, then the demo job (tensor parallel 3 on the CPU)
# make test: venv, install with test extras, then the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bytecode clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# msinfer's own modules compiled to bytecode (files changed since only): an editable install leaves
# that to the first import, which writes nothing where PYTHONDONTWRITEBYTECODE is set, and every
# worker and command then compiles them from source again (docs/architecture.md, platform notes).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q launcher worker sharding scripts tests > /dev/null

install: bytecode

demo: bytecode
	$(BIN)/python scripts/make_demo_model.py
	$(BIN)/msinfer run configs/demo.yaml --overwrite
	@echo "--- results (configs/results/demo.jsonl) ---"
	@head -c 4000 configs/results/demo.jsonl

# The tests run on the jemalloc Ray ships, as msinfer's Ray workers do (launcher/replica.py,
# WORKER_ALLOCATOR_ENV): MindSpore compiles the tests' many graphs about a fifth faster than on
# glibc's malloc. tests/test_cli.py runs a job without it, as a user's shell does.
JEMALLOC = import importlib.util, pathlib; \
	p = pathlib.Path(importlib.util.find_spec("ray").origin).parent / "core" / "libjemalloc.so"; \
	print(p if p.is_file() else "")

test: bytecode
	$(BIN)/python scripts/make_demo_model.py
	LD_PRELOAD="$$($(BIN)/python -c '$(JEMALLOC)')" $(BIN)/python -m pytest tests -q -x -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
