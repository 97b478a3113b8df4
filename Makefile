# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The dashboard's browser test drives Debian's chromium through Playwright (never a browser download).
CHROMIUM := /usr/bin/chromium
# The fleet test runs a real one-node Slurm (tests/conftest_slurm.py): Debian's daemons, started by the test.
SLURM := /usr/sbin/slurmdbd
# bench/sm90_compile.py compiles our kernels for Hopper with the Triton release the GPU hosts run (the Gluon
# kernel is written in it): that Triton alone, over the project's environment (torch and the rest, by a .pth).
SM90 := .venv-sm90
SM90_STAMP := $(SM90)/.installed
SM90_TRITON := 3.6.0

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch first, so the unpinned `torch>=2.11` below is already satisfied (no CUDA download).
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

$(SM90_STAMP): $(STAMP) Makefile
	$(PY) -m venv $(SM90)
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(SM90)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project.pth"
	$(SM90)/bin/pip install -q --no-deps "triton==$(SM90_TRITON)"
	touch $(SM90_STAMP)

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

$(SLURM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-client

.PHONY: install run test typecheck suite lint
install: $(STAMP)

run: $(STAMP)
	$(BIN)/autotune serve --local-worker

test: $(STAMP) $(SM90_STAMP) $(CHROMIUM) $(SLURM)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, set on our CI machines), each of the
	# suite's hundreds of controllers, CLI runs and rank processes would compile the project's modules anew.
	$(BIN)/python -m compileall -q -j 0 api autotune bench overlap_runtime search_spaces storage
	# The type check runs beside the suite, not before it: each is its own check and fails the target alone, and
	# on two cores mypy's 20-odd CPU-seconds then cost the suite half as much wall time as they cost alone.
	$(MAKE) --no-print-directory -j 2 typecheck suite

typecheck: $(STAMP)
	$(BIN)/mypy

suite: $(STAMP) $(SM90_STAMP) $(CHROMIUM) $(SLURM)
	# Four test files at a time, the longest first (tests/conftest.py): a test mostly waits for the controllers,
	# workers and rank processes it started, so four pytest processes keep two cores busy with their work.
	# One BLAS/OpenMP thread per process: four test processes (Triton's interpreter multiplies with numpy) beside
	# the rank processes already fill the cores, and idle BLAS threads spin before they sleep.
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/pytest -q -n 4 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
