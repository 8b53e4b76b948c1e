# GPU verification of the per-view kernels: their tests, then the step profile with and without them.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
O=${O:?set O to the output folder}; PY=${PY:-python3}; mkdir -p $O/triton $O/torch
TINY=${TINY:-}
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "view or block_table or sign or one_bit" > $O/tests.log 2>&1; tail -3 $O/tests.log
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "efsignsgd or onebit" > $O/cuda-tests.log 2>&1; tail -3 $O/cuda-tests.log
A="--compressors none,efsignsgd,onebit,signsgd --steps 9 --warmup 2 --operators 3 --operator-compressors none,efsignsgd,onebit --budget-s 120 --per-compressor-s 12"
[ -n "$TINY" ] && A="$A --tiny --device cpu --steps 1 --warmup 0 --operators 1"
timeout 130 $PY benchmarks/step_profile.py $A --out $O/triton > $O/triton/step-profile.log 2>&1; tail -25 $O/triton/step-profile.md
MERGECOMP_TRITON=0 timeout 130 $PY benchmarks/step_profile.py $A --out $O/torch > $O/torch/step-profile.log 2>&1; tail -12 $O/torch/step-profile.md
