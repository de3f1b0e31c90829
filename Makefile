# Set-up and entry points. Both targets create .venv with pip and install the project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.diffzoo-installed
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo demo-vlm test test-quick install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,train,eval,vlm,lmms]' $(TORCH)
	# LLaVA's own code, the reference the conversation tests compare with; its pins (torch 2.0, transformers 4.36)
	# would replace the stack, so it comes without them
	$(PY) -m pip install --quiet --no-deps llava-torch==1.2.2.post1
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
