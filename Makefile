# make demo   set up (if needed) and run a 2-worker compressed training benchmark on CPU
# make test   set up (if needed) and run the library's tests (tests/)
# make test-harness  the benchmark harness's tests (benchmarks/tests/)
# make test-all      both
# make bench  the default benchmark sweep (see benchmarks/)
# make plots  redraw the figures docs/results.md shows from the committed results
# make horovod  build Horovod 0.28.1 for the installed torch and install it (docs/horovod.md)
# make gpu-check OUT=<folder>  on a machine with a GPU: the CUDA tests, the Triton kernels, the
#               compressor speeds and a training-step profile, every result a file in OUT; it uses
#               the machine's python (GPU_PYTHON, default python3) with PYTHONPATH=. and installs
#               nothing (benchmarks/gpu_check.py).  make gpu-check-dry-run rehearses it on the CPU
#               (into build/gpu-check-dry-run).
# make iproute2-bundle  copy this host's ip and tc, with their libraries and loader, into
#               build/iproute2, for a machine that has none and no network (a GPU machine's
#               8-process check, benchmarks/scale_check.py real8, and the emulated cluster find it)
#
# Set-up: an active virtual environment is used as it is; otherwise .venv is created
# (with access to system packages, so a torch already installed there is respected).
# torch is installed only when none is importable: TORCH_SPEC (default torch==2.13.0,
# the CPU build on machines that provide it) is installed before the package so pip
# never pulls a CUDA build by accident.  Override, e.g. make setup TORCH_SPEC="torch==2.4.1".
# Triton (TRITON_SPEC, default triton==3.6.0) is installed the same way, only when none is
# importable and only on Linux, without dependencies (it has none that matter): the GPU
# kernels' tests run under its interpreter on the CPU.  Installing it never touches torch.

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0
GPU_PYTHON ?= python3
OUT ?= benchmarks/results/$(shell date +%Y-%m-%d)-gpu-check
ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := $(CURDIR)/.venv/bin/python
endif
STAMP := $(dir $(PY)).mergecomp-installed

.PHONY: setup demo test test-harness test-all bench plots horovod gpu-check gpu-check-dry-run iproute2-bundle clean

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml Makefile mergecomp/kernels/native_kernels.c
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(CURDIR)/.venv
	@$(PY) -c "import torch" 2>/dev/null && echo "using installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || $(PY) -m pip install "$(TORCH_SPEC)"
	@$(PY) -c "import triton" 2>/dev/null || test "$$(uname -s)" != Linux \
	  || $(PY) -m pip install --no-deps "$(TRITON_SPEC)" \
	  || echo "$(TRITON_SPEC) did not install: the Triton kernel tests will be skipped"
	$(PY) -m pip install --no-build-isolation -e ".[test,bench,plots]"
	@touch $@

demo: setup
	$(PY) compress_benchmark.py --nproc 2 --compress --compressor topk --compress-ratio 0.01 \
	  --comm allgather --memory residual --fusion-num 2 --model resnet20 --batch-size 16 \
	  --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 5

test: setup
	$(PY) -m pytest tests -q

test-harness: setup
	$(PY) -m pytest benchmarks/tests -q

test-all: test test-harness

bench: setup
	$(PY) benchmarks/sweep.py benchmarks/sweeps/default.yaml

plots: setup
	$(PY) benchmarks/plot.py results

horovod: setup
	bash tools/build_horovod.sh $(PY)

gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT)

gpu-check-dry-run: setup
	$(PY) benchmarks/gpu_check.py --dry-run --out build/gpu-check-dry-run

iproute2-bundle:
	$(PYTHON) benchmarks/harness/iproute2_bundle.py build/iproute2

clean:
	rm -rf .venv build *.egg-info .pytest_cache
