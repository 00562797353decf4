# make demo: venv, install, demo model, then the demo job (tensor parallel 3 on the CPU)
# make test: venv, install with test extras, then the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/make_demo_model.py
	$(BIN)/msinfer run configs/demo.yaml --overwrite
	@echo "--- results (configs/results/demo.jsonl) ---"
	@head -c 4000 configs/results/demo.jsonl

test: $(STAMP)
	$(BIN)/python scripts/make_demo_model.py
	$(BIN)/python -m pytest tests -q -x -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
