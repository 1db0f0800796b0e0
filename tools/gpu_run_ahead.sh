#!/usr/bin/env bash
# GPU check of the run-ahead rule (the host running ahead of the GPU). Run from the repository
# root on a CUDA machine; logs in $OUT (default ./run_ahead_out):
#     bash tools/gpu_run_ahead.sh [old] [check] [soak]      (default: check soak)
# old:   with OLD_AUX=path, the repro, the conformance TestRunAhead and a short soak with that
#        older kvcache/core/aux.py swapped in (to record that they fail there)
# check: the repro and the conformance TestRunAhead on the current code
# soak:  the 2000-forward soak, a graph-mode soak, a memcheck soak and the profiler proof
set -u
OUT=${OUT:-$PWD/run_ahead_out}; mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() {  # name seconds cmd...
    local name=$1 limit=$2; shift 2
    echo "==== $name"
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$(printf '%-34s' "$name") rc=$rc  (t+$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/summary.txt"
    tail -n 6 "$OUT/$name.log"
}
$PY -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > "$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
CONF="$PY -m kvcache.cli conformance --backend cuda"
PARTS=${*:-check soak}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if has old && [ -n "${OLD_AUX:-}" ]; then
    cp kvcache/core/aux.py "$OUT/aux.new.py"; cp "$OLD_AUX" kvcache/core/aux.py
    step old_repro 120 $PY tools/run_ahead_stress.py repro
    step old_conformance_run_ahead 150 $CONF -k RunAhead
    step old_soak_300 100 $PY tools/run_ahead_stress.py soak --forwards 300
    cp "$OUT/aux.new.py" kvcache/core/aux.py
fi
if has check; then
step repro 120 $PY tools/run_ahead_stress.py repro
step conformance_run_ahead 150 $CONF -k RunAhead
fi
if has soak; then
step ${SOAK_NAME:-soak_2000} ${SOAK_LIMIT:-300} $PY tools/run_ahead_stress.py soak --forwards ${SOAK_FORWARDS:-2000}
step soak_graph 200 $PY tools/run_ahead_stress.py soak --forwards ${GRAPH_FORWARDS:-1000} --graph --seed 1
step memcheck_soak 240 compute-sanitizer --tool memcheck --error-exitcode 9 $PY tools/run_ahead_stress.py soak --forwards 40 --layers 4 --chunk 1024 --max-tokens 16384 --seed 2
step profile 120 $PY tests/cuda/gpu_profile_check.py "$OUT"
fi
