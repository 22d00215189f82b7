# Two commands users need: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU wheel of torch 2.13.0 (on disk here); a GPU machine keeps its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint format bench-smoke clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[server,test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kiln demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two workers (CI has 2 cores), a file per worker at a time: module fixtures build once.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile
	$(PY) -m pytest -q bench --benchmark-disable -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
