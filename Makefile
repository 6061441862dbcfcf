# Every target sets itself up: on a fresh machine `make test` or `make demo` is all it takes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch where no NVIDIA GPU is present, so setup never pulls the multi-GB CUDA build.
# TORCH_CPU_INDEX_URL may name a PyTorch CPU wheel index (the GitHub workflows set it); empty means pip's defaults.
TORCH_CPU_VERSION ?= 2.13.0
TORCH_CPU_INDEX_URL ?=
PYTEST_ARGS ?=
# Extra arguments for every `pip install` of the setup (the floor job passes its constraints here).
PIP_INSTALL_ARGS ?=
# The supported-version floor: its own environment, so that .venv is left alone.
FLOOR_VENV ?= .venv-floor

.PHONY: setup test lint typecheck unittest floor demo docs build clean

$(VENV)/.installed: pyproject.toml setup.py requirements/base.txt requirements/test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CachedDataset tests run a real redis-server, and the codec's CPU kernels build with ninja (Debian's packages).
	if { ! command -v redis-server || ! command -v ninja; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server ninja-build; \
	fi
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)" $(PIP_INSTALL_ARGS) $(if $(TORCH_CPU_INDEX_URL),--extra-index-url $(TORCH_CPU_INDEX_URL)); \
	fi
	$(PY) -m pip install -q -e ".[test]" $(PIP_INSTALL_ARGS)
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy

unittest: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck unittest

# The floor environment follows requirements/floor.txt: a changed floor reinstalls it.
$(FLOOR_VENV)/.installed: requirements/floor.txt

# The whole suite on the lowest declared versions, which requirements/floor.txt pins. Its torch comes from
# TORCH_CPU_INDEX_URL where set (a CPU build), else from PyPI, whose Linux wheel is a CUDA build that runs on CPU too.
floor:
	$(MAKE) unittest VENV=$(FLOOR_VENV) TORCH_CPU_VERSION=$$(sed -n 's/^torch==//p' requirements/floor.txt) \
		PIP_INSTALL_ARGS="-c requirements/floor.txt" PYTEST_ARGS="$(PYTEST_ARGS)"
	$(FLOOR_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|lightning|pytorch-lightning) '

demo: setup
	$(PY) examples/train.py --devices 2 --accelerator cpu --algorithm gradient_allreduce

$(VENV)/.docs-installed: $(VENV)/.installed requirements/docs.txt
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	# -E: read every page on every build, so warnings of unchanged pages are never skipped.
	$(PY) -m sphinx -E -W --keep-going -b html docs/source docs/build/html

build: setup
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build dist docs/build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
