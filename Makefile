# Two commands do all set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies here on our machines; pip must never fetch a CUDA build.
WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)
ARGS ?=
# Test processes: XLA compiles on one core, so two workers keep both of a 2-core machine busy.
# Whole modules go to one worker (loadscope) so module fixtures (reference runs) are built once.
TEST_WORKERS ?= 2

.PHONY: train test test-extended test-fast test-py312 test-e2e test-reference test-full-size docs venv clean

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) -e '.[test]'
	touch $@

venv: $(VENV)/.stamp

train: $(VENV)/.stamp
	$(PY) -m jaxtrain.train --gin_file=configs/default.gin --workdir=runs/default $(ARGS)

test: $(VENV)/.stamp
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope -m "not reference_layout and not full_size and not extended" $(ARGS)

# What `make test` leaves out for its time budget, each with a unit-level part or a model-level twin
# in the suite: process-level runs (hangs in each phase of a run, signals, peer failures, non-finite
# steps, resumes under a changed optimizer, the GPU check's dry run, the profiler, the notebook) and
# further layouts of the suite's comparisons against one device. CI runs it after the suite; measured
# times are in benchmarks/RESULTS.md.
test-extended: $(VENV)/.stamp
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope -m "extended" $(ARGS)

# The part of `make test` that starts real processes of the CLIs, scripts or a Jupyter kernel:
# fault injections (tests/faults/), multi-process runs, the GPU check's dry run, the CLI,
# profiler and notebook runs (tests/conftest.py END_TO_END).
test-e2e: $(VENV)/.stamp
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope -m "end_to_end" $(ARGS)

# The quick unit-level tests, for the edit-test loop (< 3 min): the modules that declare the fast
# lane, less their tests marked slow (a model-size compile or a whole run) or end_to_end (tests/conftest.py).
test-fast: $(VENV)/.stamp
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope -m "fast and not slow and not end_to_end" $(ARGS)

# The quick lane on Python 3.12 with the newest jax the pins allow (what the GPU image and a new
# user on 3.12 get), in its own venv. The test extra's torch-based references are for 3.11 only
# (the CPU torch build on disk is cp311), so their tests skip there.
PYTHON312 ?= python3.12
test-py312:
	$(MAKE) test-fast PYTHON=$(PYTHON312) VENV=.venv312 ARGS="$(ARGS)"

# The 16-device reference layout end to end (27- and 52-layer models, 20 steps, resumes): ~7 min
# on two cores, so it is its own target; CI runs it after the suite.
test-reference: $(VENV)/.stamp
	JAXTRAIN_SLOW_TESTS=1 $(PY) -m pytest tests -m reference_layout $(ARGS)

# The layout planner against XLA's compiled memory at full size (Llama-3-8B, DeepSeek-V2-Lite,
# Nemotron-3-Nano; compile only, ~10 full-size compiles): its own target; CI runs it too.
test-full-size: $(VENV)/.stamp
	$(PY) -m pytest tests -m full_size -s $(ARGS)

# The docs site into site/ (mkdocs.yml; the reference pages are generated from the code by
# docs/hooks/reference.py). --strict: a broken link or a page missing from the nav fails the build.
docs: $(VENV)/.stamp
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs site
