# The two commands of the README. Each does all of its own set-up from a fresh clone.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# MLX's backend for this machine (an extra in pyproject.toml): metal on macOS; cuda or cuda12
# where nvidia-smi lists a GPU (by the CUDA version its driver supports); else cpu.
# Override with `make run MLX_BACKEND=cpu`.
ifndef MLX_BACKEND
MLX_BACKEND := $(shell if [ "$$(uname)" = Darwin ]; then echo metal; \
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
    v=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -1); \
    if [ -n "$$v" ] && [ "$$v" -lt 13 ]; then echo cuda12; else echo cuda; fi; \
  else echo cpu; fi)
endif

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml $(VENV)/.backend-$(MLX_BACKEND)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,$(MLX_BACKEND)]'
	touch $(STAMP)

$(VENV)/.backend-$(MLX_BACKEND):
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.backend-*
	touch $@

# The default sweep (smoke) on this machine through an embedded Ray instance.
run: $(STAMP)
	@echo "MLX backend installed: $(MLX_BACKEND) (orchestrate is $(VENV)/bin/orchestrate)"
	$(VENV)/bin/orchestrate run

# The whole suite: system packages and loopback services the tests need, then ruff (lint and
# format), mypy and pytest.
test: $(STAMP)
	bash tests/setup-system.sh
	bash tests/setup-py312.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.overhead

clean:
	rm -rf $(VENV) build *.egg-info
