#!/usr/bin/env bash
# GPU check of masked non-finite keys (the Triton kernels' MASKED path). Run from the repository
# root on a CUDA machine; logs in $OUT (default ./numerics_out):
#     OLD_TRITON=path/to/older/triton_kernels.py bash tools/gpu_numerics.sh
# 1. the kernel tests for non-finite keys and the conformance suite on the GPU (every dtype and
#    head_dim of the matrix must compile: shared memory and registers are per-GPU limits);
# 2. prefill benchmarks of the current kernels and, with OLD_TRITON, of the older file swapped in,
#    alternated twice so drift shows.
set -u
OUT=${OUT:-$PWD/numerics_out}; mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
$PY -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > "$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
run() { local name=$1 limit=$2; shift 2; echo "==== $name"
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" | tee -a "$OUT/summary.txt"; tail -n 4 "$OUT/$name.log"; }
run kernel_tests 200 env KVCACHE_CUDA_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    -k "nonfinite or nan" tests/cuda/test_cuda_kernels.py tests/cuda/test_cuda_conformance_nonfinite.py
[ -n "${SKIP_CONFORMANCE:-}" ] || run conformance 420 $PY -m kvcache.cli conformance --backend cuda
K=backends/cuda/kvcache_cuda/triton_kernels.py
cp $K "$OUT/triton_kernels.new.py"
for round in 1 2; do
    cp "$OUT/triton_kernels.new.py" $K
    run bench_new_$round 120 $PY -m kvcache.cli bench --backend cuda --only prefill
    if [ -n "${OLD_TRITON:-}" ]; then
        cp "$OLD_TRITON" $K
        run bench_old_$round 120 $PY -m kvcache.cli bench --backend cuda --only prefill
    fi
done
cp "$OUT/triton_kernels.new.py" $K
grep -h "prefill-" "$OUT"/bench_*.log | head -0
for f in "$OUT"/bench_*.log; do echo "--- $(basename $f)"; grep "prefill-" "$f"; done
