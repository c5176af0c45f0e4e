# Two commands do all set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies here on our machines; pip must never fetch a CUDA build.
WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)
ARGS ?=

.PHONY: train test venv clean

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(FIND_LINKS) -e '.[test]'
	touch $@

venv: $(VENV)/.stamp

train: $(VENV)/.stamp
	$(PY) -m jaxtrain.train --gin_file=configs/default.gin --workdir=runs/default $(ARGS)

test: $(VENV)/.stamp
	$(PY) -m pytest tests $(ARGS)

clean:
	rm -rf $(VENV) runs
