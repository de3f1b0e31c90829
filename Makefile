# Set-up and entry points. Both targets create .venv with pip and install the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.diffzoo-installed
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo demo-vlm test test-quick install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,train,eval,vlm,lmms]' $(TORCH)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m diffzoo.demo

demo-vlm: $(STAMP)
	$(PY) -m diffzoo.demo_vlm

test: $(STAMP)
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder

test-quick: $(STAMP)
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
