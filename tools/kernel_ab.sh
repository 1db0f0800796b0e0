#!/usr/bin/env bash
# Kernel times of two trees on one GPU, alternated so drift between runs shows (an A/B on one
# machine: H100s of the same kind differ by up to 20% between runs, docs/performance.md).
#   here:       BASE=791c961 bash tools/kernel_ab.sh prepare     (writes .ab/base.tar, ignored)
#   on the GPU: bash tools/kernel_ab.sh                          (device tool: carry [".ab"])
# Runs `kvcache bench --backend cuda --only $ONLY` (default decode,graphs) and this tree's
# tools/graph_step_kernels.py (a captured decode step's time per kernel) ROUNDS times (default 2)
# for the base tree and this one, each on the same installed entry points: the modules come from
# PYTHONPATH. Logs and a summary in $OUT (default ./ab-out).
set -u
if [ "${1:-}" = prepare ]; then
    mkdir -p .ab && git archive --format=tar -o .ab/base.tar "${BASE:?BASE=<commit>}" kvcache backends/cuda
    echo "$BASE" > .ab/BASE; echo "wrote .ab/base.tar ($BASE)"; exit 0
fi
OUT=${OUT:-$PWD/ab-out}; mkdir -p "$OUT" /tmp/ab-base
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
$PY -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda > "$OUT/install.log" 2>&1
tar -xf .ab/base.tar -C /tmp/ab-base
echo "base $(cat .ab/BASE 2>/dev/null) vs this tree; $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee "$OUT/summary.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in new base; do
        tree=$PWD; [ $side = base ] && tree=/tmp/ab-base
        PYTHONPATH=$tree:$tree/backends/cuda $PY -c "import kvcache_cuda; print(kvcache_cuda.__file__)" \
            > "$OUT/${side}_$round.log" 2>&1
        PYTHONPATH=$tree:$tree/backends/cuda timeout 200 $PY -m kvcache.cli bench --backend cuda \
            --only "${ONLY:-decode,graphs}" >> "$OUT/${side}_$round.log" 2>&1
        echo "== $side round $round (rc $?)" | tee -a "$OUT/summary.txt"
        PYTHONPATH=$tree:$tree/backends/cuda timeout 120 $PY tools/graph_step_kernels.py \
            >> "$OUT/${side}_$round.log" 2>&1
        head -1 "$OUT/${side}_$round.log" | tee -a "$OUT/summary.txt"
        grep -E "^decode|^prefill|^append|^ +[0-9]+ +[0-9.]+ |^B=[0-9]+ replay|^    [_a-z]" \
            "$OUT/${side}_$round.log" | tee -a "$OUT/summary.txt"
    done
done
