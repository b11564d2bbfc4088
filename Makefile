# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing. Without a GPU the CPU build of torch 2.13.0 is
# pinned (a plain `pip install torch` pulls several GB of CUDA wheels) with triton 3.7.1,
# the version torch 2.13 pairs with; the Triton interpreter runs the kernels on the CPU.
# With a GPU the venv sees the system's CUDA torch and Triton (--system-site-packages).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Wheels placed in .whl/ are preferred over the index; on a GPU machine they are the only
# source (offline machines) and the package builds with the environment's setuptools.
FIND_LINKS := $(if $(wildcard .whl/*.whl),--find-links .whl,)
OFFLINE := $(if $(and $(HAS_GPU),$(FIND_LINKS)),--no-index,)
MCORE := megatron-core==0.19.2
NPROC ?= $(if $(HAS_GPU),$(shell nvidia-smi -L | wc -l),2)
# pytest-xdist workers for `make test`, each taking whole test modules (2: the CI machine's cores)
TEST_WORKERS ?= 2

.PHONY: demo test test-gpu bench-planner clean venv

venv: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(if $(HAS_GPU),--system-site-packages,) $(VENV)
ifeq ($(HAS_GPU),)
	$(PIP) install -q torch==2.13.0 triton==3.7.1
else
	# The machine's CUDA torch may live in another venv (the one `python3` runs from):
	# make its site-packages visible too, instead of downloading several GB of wheels.
	$(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
	    > "$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_machine_site.pth"
endif
	# megatron-core 0.19.x declares Python >= 3.12 but ships a cp311 wheel that works;
	# without the flag pip silently picks 0.16.1, whose MoE spec API differs.
	$(PIP) install -q $(FIND_LINKS) $(OFFLINE) --no-deps --ignore-requires-python $(MCORE)
	$(PIP) install -q $(FIND_LINKS) $(OFFLINE) $(if $(OFFLINE),--no-build-isolation,) \
	    -e '.[test,bench]'
	touch $@

demo: $(VENV)/.ready
	$(PY) -m megatron_overlap demo --nproc $(NPROC)

test: $(VENV)/.ready
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

test-gpu: $(VENV)/.ready
	$(PY) -m pytest -q -m gpu tests

bench-planner: $(VENV)/.ready
	$(PY) tools/bench_planner.py

clean:
	rm -rf $(VENV) build *.egg-info
