# Two commands on a fresh machine (Python 3.11+ and pip):  make demo   |   make test
# Both install into .venv first (once); the CPU build of torch comes first so pip never pulls a
# multi-GB CUDA build on a CPU machine. On a GPU box: make install TORCH=torch==2.11.0 TORCH_INDEX= EXTRAS=dev,notebook,sglang
# (sglang 0.5.17, which the sglang extra pins, requires torch 2.11.0)
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= dev,notebook

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# few retries: where the PyTorch index is unreachable (offline mirrors, CI) pip falls back to
	# its local find-links at once instead of backing off for minutes
	$(VENV)/bin/python -m pip install -q --retries 1 --timeout 20 "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) \
	  || $(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# the browser test's own tool (Playwright's driver; the browser is the system's Chromium)
$(VENV)/.browser-test: $(VENV)/.installed tests/browser_requirements.txt
	$(VENV)/bin/python -m pip install -q -r tests/browser_requirements.txt
	touch $@

demo: install
	$(VENV)/bin/lorabench demo

test: install $(VENV)/.browser-test
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m pytest -q

.PHONY: install demo test
