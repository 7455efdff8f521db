# The two commands of the README. Each does all of its own set-up from a fresh clone.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

# The default sweep (smoke) on this machine through an embedded Ray instance.
run: $(STAMP)
	$(VENV)/bin/orchestrate run

# The whole suite: system packages and loopback services the tests need, then pytest, ruff, mypy.
test: $(STAMP)
	bash tests/setup-system.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.overhead

clean:
	rm -rf $(VENV) build *.egg-info
