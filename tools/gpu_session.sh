#!/usr/bin/env bash
# One GPU session (run on the lent H100 from the repo root): install, kernel tests on CUDA,
# conformance for `cuda`, the profiler proof, benchmarks, the demo. Each section is independent;
# logs land in $OUT (or ./gpu-out). STEPS picks sections, e.g. the serving issue's checks:
#   STEPS="engine runahead launch serving" bash tools/gpu_session.sh     (about 9 minutes)
# issue 27 (attention features, every model family):  STEPS="features" / STEPS="families"
# issue 31 (captured mixed steps, about 8 minutes): STEPS="mixed"
# issue 33 item 1 (the fourth conformance group, the persistent lab, about 8 minutes): STEPS="prefill33"
# issue 33 item 1, the paged prefill kernel's warp_uniform_scalars off against on (about 3 minutes):
#   STEPS="uniform33"
# and the decode kernels of two trees on one machine (issue 16's "kernel times within 5%"):
#   here: BASE=791c961 bash tools/kernel_ab.sh prepare;  there (carry [".ab"]): STEPS=ab ...
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
section() { echo; echo "=================== $1 ($(date +%T))"; }
section "setup"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda -e backends/rocm -e docs/examples/kvcache-example 2>&1 | grep -v -i warning | tail -3
python3 -m kvcache.cli info 2>&1 | head -8
for step in ${STEPS:-tests conformance profile bench demo}; do
  case $step in
    tests) section "tests/cuda on the GPU, the collected tests split over ${PARTS:-6} processes at once (a cold machine spends minutes compiling kernels on its CPU; about 8 minutes)"
      KVCACHE_CUDA_TEST_DEVICE=cuda python3 -m pytest --collect-only -q tests/cuda -p no:cacheprovider 2>/dev/null | grep '::' > "$OUT/cuda_ids.txt"
      rm -f "$OUT"/cuda_part_*; split -n "r/${PARTS:-6}" "$OUT/cuda_ids.txt" "$OUT/cuda_part_"
      for f in "$OUT"/cuda_part_??; do      # ids from a file: some hold spaces
        (KVCACHE_CUDA_TEST_DEVICE=cuda timeout 560 python3 -c "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider'] + open(sys.argv[1]).read().splitlines()))" "$f" > "$f.log" 2>&1
         echo "$(basename "$f") rc $?: $(tail -1 "$f.log")") &
      done; wait
      grep -h "^FAILED\|^ERROR" "$OUT"/cuda_part_*.log | head -20 ;;
    conformance) section "conformance --backend cuda"
      timeout 300 python3 -m kvcache.cli conformance --backend cuda ${CONF_ARGS:-} --report "$OUT/conformance_cuda.md" 2>&1 | tee "$OUT/conformance.log" | tail -40 ;;
    profile) section "profiler proof"
      timeout 120 python3 tests/cuda/gpu_profile_check.py "$OUT" 2>&1 | tail -25 ;;
    bench) section "kvcache bench --backend cuda"
      timeout 300 python3 -m kvcache.cli bench --backend cuda 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    demo) section "kvcache demo --backend cuda"
      timeout 200 python3 -m kvcache.cli demo --backend cuda ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" | tail -30 ;;
    serving) section "kvcache bench --serving --model llama (a, b, c: about 5 minutes)"
      timeout 420 python3 -m kvcache.cli bench --serving --model llama --json > "$OUT/serving.json" 2> "$OUT/serving.err"
      tail -4 "$OUT/serving.err"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: (round(v['tokens_per_s'], 1), round(v['decode_step_ms'], 3), v['gpu_busy']) for k, v in r['systems'].items()}, r['ratios'])" "$OUT/serving.json" ;;
    compile) section "issue 33: the compiled decode step: tokens against eager (Inductor, CUDA graphs), then (a) with and without it"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -s tests/integrations/test_engine_compile.py -p no:cacheprovider 2>&1 | grep -a -v -i warn | tail -6
      for i in ${ROUNDS:-1 2}; do for cs in off on; do
        flag=""; [ $cs = on ] && flag="--compile-step"
        timeout 240 python3 -m kvcache.cli bench --serving --model llama --skip b,c --no-busy ${SERVING_ARGS:-} $flag --json > "$OUT/cs_$cs$i.json" 2> "$OUT/cs_$cs$i.err"
        python3 -c "import json, sys; r = json.load(open(sys.argv[1])); a = r['systems']['a']; print(sys.argv[2], round(a['tokens_per_s'], 1), 'tok/s, step', round(a['decode_step_ms'], 3), 'ms, roofline', round(r['roofline']['decode_step_ms'], 3), 'ms, ratio', round(a['decode_step_ms'] / r['roofline']['decode_step_ms'], 3))" "$OUT/cs_$cs$i.json" "$cs$i" || tail -5 "$OUT/cs_$cs$i.err"
      done; done ;;
    engine) section "engine: overlapped and pipelined graph steps against eager ones"
      timeout 150 python3 -m pytest -q -x tests/integrations/test_engine_graphs.py -k gpu 2>&1 | tail -3 ;;
    launch) section "eager decode host time per layer"
      timeout 150 python3 tools/launch_overhead.py 2>&1 | tee "$OUT/launch.log" | tail -8 ;;
    runahead) section "conformance: the run-ahead class"
      timeout 200 python3 -m kvcache.cli conformance --backend cuda -k RunAhead 2>&1 | tail -6 ;;
    breakdown) section "one decode step of (a), kernel by kernel; decode tiles at its shape"
      timeout 300 python3 tools/decode_step_breakdown.py --rope cache --sweep > "$OUT/breakdown.txt" 2>&1
      grep -a -v -i warn "$OUT/breakdown.txt" | head -30 ;;
    ab) section "kernel times: this tree against .ab/base.tar (BASE=<commit> bash tools/kernel_ab.sh prepare; carry .ab)"
      OUT="$OUT/ab" timeout 560 bash tools/kernel_ab.sh | tail -40 ;;
    features) section "issue 27: soft-capping, sinks, head_dim_v, head dims: kernel tests and conformance classes on the GPU"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q tests/cuda/test_cuda_attention_features.py \
        tests/cuda/test_cuda_graph_mode.py -k "softcap or sink or head_dim or attention_features" -p no:cacheprovider 2>&1 | tail -6
      timeout 300 python3 -m kvcache.cli conformance --backend cuda \
        -k "Softcap or Sinks or MixedWindow or HeadDim or WindowLeft" 2>&1 | tail -14 ;;
    families) section "issue 27: every family at 8B-like attention shapes, bf16, against transformers' own generate"
      timeout 560 python3 tools/gpu_hf_check.py ${FAMILY_ARGS:-} 2>&1 | grep -a -v -i "warn" | tee "$OUT/families.log" | tail -40 ;;
    flash55) section "issue 55: FlashAttention prefill: its tests and the prefill kernel tests on the GPU beside the whole conformance suite with KVCACHE_CUDA_FLASH=on (about 6 minutes)"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_flash.py \
        tests/cuda/test_cuda_kernels.py -k "flash or library or ragged or paged_prefill or gather" > "$OUT/flash_tests.log" 2>&1 &
      KVCACHE_CUDA_FLASH=on timeout 540 python3 -m kvcache.cli conformance --backend cuda --report "$OUT/conformance_flash.md" > "$OUT/conformance_flash.log" 2>&1
      echo "conformance rc $?"; tail -25 "$OUT/conformance_flash.log"; wait
      grep -a "passed\|failed\|^FAILED\|^ERROR" "$OUT/flash_tests.log" | tail -15 ;;
    fix55) section "issue 55: conformance classes (CONF_K) and the flash tests, with KVCACHE_CUDA_FLASH=on"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout ${FIX_S:-200} python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_flash.py \
        tests/cuda/test_cuda_attention_features.py -k "flash or library or softcap or sink" > "$OUT/flash_tests.log" 2>&1 &
      KVCACHE_CUDA_FLASH=on timeout ${FIX_S:-200} python3 -m kvcache.cli conformance --backend cuda -k "${CONF_K:-AttentionSinks or LogitSoftcap or HeadDimV or MixedWindow or NonFinite}" > "$OUT/conformance_fix.log" 2>&1
      echo "conformance rc $?"; grep -a "passed\|FAILED\|verdict" "$OUT/conformance_fix.log" | tail -8; wait
      grep -a "passed\|failed\|^FAILED\|^ERROR" "$OUT/flash_tests.log" | tail -8 ;;
    bench55) section "issue 55: prefill Triton against FlashAttention against SDPA, fp8 against 16-bit, the dispatch thresholds (about 4 minutes)"
      cp backends/cuda/kvcache_cuda/tuning_table.json "$OUT/tuning_table.json"
      timeout ${TUNE_S:-240} python3 -m kvcache_cuda.tune --only flash --write --table "$OUT/tuning_table.json" 2>&1 | grep -a -v -i warn | tail -20
      cp "$OUT/tuning_table.json" backends/cuda/kvcache_cuda/tuning_table.json
      timeout ${BENCH_S:-300} python3 -m kvcache_cuda.bench --only ${BENCH_ONLY:-decode,prefill,fp8} --json "$OUT/bench55.json" 2>&1 | grep -a -v -i warn | tee "$OUT/bench55.log" | tail -40 ;;
    verify7) section "issues 55-57 (2026-11-28, seventh session): the window-groups budget row and the KV files bench alone, then correctness side by side (about 5 minutes)"
      timeout 80 python3 tools/window_groups_budget.py cuda --device cuda --dtype bfloat16 --layers 12 --hidden 1024 \
        --heads 8 --kv-heads 4 --head-dim 128 --window 512 --prompt 2048 --new 64 --requests 64 --batch 32 \
        --chunk 2048 --budget-tokens 16384 2>&1 | grep -a -v -i warn | tail -4
      timeout 50 python3 -m kvcache.cli bench --files --files-dir "${FILES_DIR:-/tmp}" 2>&1 | grep -a -v -i warn | tail -8
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_flash.py \
        tests/transfer/test_kv_files.py tests/transfer/test_kv_files_prefix.py tests/transfer/test_verified_moves.py \
        > "$OUT/tests7.log" 2>&1 &
      timeout 240 python3 -m kvcache.cli conformance --backend cuda -k "WindowGroups or StateSlots" > "$OUT/conf_groups.log" 2>&1 &
      KVCACHE_CUDA_FLASH=on timeout 245 python3 -m kvcache.cli conformance --backend cuda --jobs 8 > "$OUT/conf_flash.log" 2>&1
      echo "conformance flash=on rc $?"; grep -a "verdict\|pytest:" "$OUT/conf_flash.log" | tail -3
      awk '/^  Test/ && NF == 5 && $3 != "0" {print "  failed in", $0}' "$OUT/conf_flash.log"; wait
      grep -a "verdict\|pytest:" "$OUT/conf_groups.log" | tail -3
      grep -a "passed\|failed\|^FAILED\|^ERROR" "$OUT/tests7.log" | tail -12 ;;
    verify8) section "issues 55-57 (2026-11-28, eighth session): fp8 serving and the KV files bench alone, then correctness side by side (about 4 minutes)"
      for kv in auto float8_e4m3; do
        timeout 100 python3 -m kvcache.cli bench --serving --model llama --skip b,c --no-busy --kv-dtype $kv 2>&1 | grep -a "^(a)\|decode step /"
      done
      timeout 50 python3 -m kvcache.cli bench --files --files-dir "${FILES_DIR:-/tmp}" 2>&1 | grep -a -v -i warn | tail -6
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_kv_files.py \
        tests/transfer/test_kv_files_prefix.py tests/transfer/test_verified_moves.py > "$OUT/tests8.log" 2>&1 &
      [ -f tools/gpu_lfm2_check.py ] && timeout 200 python3 tools/gpu_lfm2_check.py > "$OUT/lfm2.log" 2>&1 &
      timeout 200 python3 -m kvcache.cli conformance --backend cuda -k "WindowGroups or StateSlots" > "$OUT/conf_groups8.log" 2>&1
      wait; grep -a "verdict\|pytest:" "$OUT/conf_groups8.log" | tail -3
      awk '/^  Test/ && NF == 5 && $3 != "0" {print "  failed in", $0}' "$OUT/conf_groups8.log"
      [ -f "$OUT/lfm2.log" ] && grep -a -v -i warn "$OUT/lfm2.log" | tail -8
      grep -a "passed\|failed\|^FAILED\|^ERROR" "$OUT/tests8.log" | tail -8 ;;
    prefix) section "issue 31: prefix cache warm = cold on the GPU, conformance -k Prefix"
      timeout 280 python3 tools/gpu_prefix_check.py 2>&1 | grep -a -v -i warn | tee "$OUT/prefix_check.log" | tail -16 &
      timeout 280 python3 -m kvcache.cli conformance --backend cuda -k Prefix 2>&1 | tail -4; wait ;;
    prefix_ab) section "issue 31: the random serving workload, prefix cache on against off, twice each"
      for i in 1 2; do for pc in on off; do
        timeout 200 python3 -m kvcache.cli bench --serving --model llama --skip b,c --no-busy --prefix-cache $pc --json > "$OUT/ab_$pc$i.json" 2>/dev/null
        python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], {k: round(v['tokens_per_s'], 1) for k, v in r['systems'].items()})" "$OUT/ab_$pc$i.json" "$pc$i"
      done; done ;;
    prefix_work) section "issue 31: shared-prefix and multi-turn workloads"
      for w in shared-prefix multi-turn; do
        timeout 280 python3 -m kvcache.cli bench --serving --workload $w --json > "$OUT/$w.json" 2> "$OUT/$w.err"
        python3 -c "import json, sys; from kvcache.bench.serving.prefix import print_prefix_result as p; p(json.load(open(sys.argv[1])))" "$OUT/$w.json" || tail -5 "$OUT/$w.err"
      done ;;
    prefix_profile) section "issue 31: where the shared-prefix run's host time goes"
      timeout 200 python3 tools/profile_prefix.py ${PROFILE_ARGS:-} > "$OUT/prefix_profile.txt" 2>&1
      grep -a -v -i warn "$OUT/prefix_profile.txt" | head -120 | cut -c1-160 ;;
    fp8) section "issue 32: fp8 pages: kernel tests, conformance (all classes) side by side; then the fp8 bench"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q tests/cuda -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1 &
      timeout 420 python3 -m kvcache.cli conformance --backend cuda ${CONF_ARGS:-} > "$OUT/conformance.log" 2>&1; wait
      tail -15 "$OUT/cuda_tests.log"; grep -a -A40 "conformance summary" "$OUT/conformance.log" | head -60
      timeout 240 python3 -m kvcache.cli bench --backend cuda --only ${BENCH_ONLY:-decode,prefill,fp8} 2>&1 | tee "$OUT/bench_fp8.log" | tail -30 ;;
    kv_budget) section "issue 32: serving at one KV memory budget, 16-bit pages against fp8"
      timeout 400 python3 -m kvcache.cli bench --serving --workload kv-budget --kv-dtype float8_e4m3 ${BUDGET_ARGS:-} > "$OUT/kv_budget.txt" 2> "$OUT/kv_budget.err"
      cat "$OUT/kv_budget.txt"; tail -4 "$OUT/kv_budget.err" ;;
    mixed) section "issue 31: captured mixed steps: tokens against eager mixed steps, attention per layer, then the shared-prefix and random workloads with and without them"
      timeout 150 python3 tools/gpu_mixed_check.py --layers 2 2>&1 | grep -a -v -i warn | tail -3
      timeout 100 python3 tools/mixed_step_kernels.py 2>&1 | grep -a -v -i warn | cut -c1-140 | tail -4
      for m in off on; do
        timeout 140 python3 -m kvcache.cli bench --serving --workload shared-prefix --skip b --mixed-graphs $m --json > "$OUT/sp_$m.json" 2> "$OUT/sp_$m.err"
        python3 -c "import json, sys; from kvcache.bench.serving.prefix import print_prefix_result as p; p(json.load(open(sys.argv[1])))" "$OUT/sp_$m.json" | grep -a "on)\|off)\|/ off\|/ on" || tail -3 "$OUT/sp_$m.err"
      done
      for m in off on; do
        timeout 120 python3 -m kvcache.cli bench --serving --model llama --skip b,c --no-busy --mixed-graphs $m --json > "$OUT/rnd_$m.json" 2>/dev/null
        python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], {k: (round(v['tokens_per_s'], 1), round(v.get('decode_step_ms') or 0, 3)) for k, v in r['systems'].items()})" "$OUT/rnd_$m.json" "random, mixed graphs $m"
      done ;;
    prefill33) section "issue 33 item 1: conformance's fourth group alone, then the persistent prefill lab and the prefill bench (about 8 minutes)"
      timeout 420 python3 -m kvcache.cli conformance --backend cuda --no-model -k "LogitSoftcap or AttentionSinks or MixedWindowLayers or HeadDimV or HeadDims or OwnAttention or Fork or Popn or SlidingWindow or TokenTree" > "$OUT/conf_group4.log" 2>&1
      grep -a -E "passed|failed|CONFORMS" "$OUT/conf_group4.log" | tail -3
      timeout 150 python3 tools/prefill_lab.py --persistent 2>&1 | grep -a -v -i warn | tee "$OUT/persistent.log" | tail -24
      timeout 120 python3 -m kvcache.cli bench --backend cuda --only prefill,features 2>&1 | tee "$OUT/bench_prefill.log" | grep -a "^prefill" ;;
    uniform33) section "issue 33 item 1: warp_uniform_scalars: its kernel tests, then off against on in one process (about 3 minutes)"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q tests/cuda/test_cuda_kernels.py -k warp_uniform -p no:cacheprovider 2>&1 | tail -2
      timeout 200 python3 tools/prefill_lab.py --uniform 2>&1 | grep -a -v -i warn | tee "$OUT/uniform.log" | tail -16 ;;
    serve_profile) section "where the serving run's time goes"
      timeout 300 python3 tools/profile_engine.py --serve > "$OUT/serve_profile.txt" 2>&1
      grep -a "whole run\|idle gaps\|ms .* gaps\|profiled" "$OUT/serve_profile.txt" | cut -c1-200 ;;
    det54) section "issue 54: deterministic mode on the GPU, three correctness jobs side by side (about 5 minutes)"
      (KVCACHE_CUDA_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_invariant_triton_ops.py tests/cuda/test_cuda_batch_invariant.py > "$OUT/det_ops.log" 2>&1; echo "ops + cache kernels rc $?: $(tail -1 "$OUT/det_ops.log")") &
      (timeout 500 python3 -m pytest -q -p no:cacheprovider tests/integrations/test_engine_deterministic.py -k gpu > "$OUT/det_engine.log" 2>&1; echo "engine on the GPU rc $?: $(tail -1 "$OUT/det_engine.log")") &
      (timeout 500 python3 -m kvcache.cli conformance --backend cuda --full -k TestBatchInvariance --jobs 4 > "$OUT/det_conf.log" 2>&1; echo "conformance rc $?: $(grep -a -E "passed|failed" "$OUT/det_conf.log" | tail -1)") &
      wait
      grep -a -h "^FAILED\|^ERROR\|Error\|assert" "$OUT"/det_*.log | head -20 ;;
    det54cost) section "issue 54: what deterministic mode costs (random workload B=64, (a) and (d) in one run), then the shared-prefix check"
      timeout 330 python3 -m kvcache.cli bench --serving --model llama --skip b,c --deterministic > "$OUT/det_cost.log" 2>&1; tail -22 "$OUT/det_cost.log"
      timeout 250 python3 -m kvcache.cli bench --serving --workload shared-prefix --skip b --deterministic > "$OUT/det_prefix.log" 2>&1; tail -12 "$OUT/det_prefix.log" ;;
    nonfinite55) section "issue 55 (2026-11-29, thirteenth session): cuDNN's calls unchecked; correctness side by side (flash tests, the whole quick conformance with the library on, Numerics with the default dispatch), then the prefill bench alone (about 6 minutes)"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_flash.py > "$OUT/flash_tests.log" 2>&1 &
      timeout 300 python3 -m kvcache.cli conformance --backend cuda -k "Numerics or Forward" > "$OUT/conf_default.log" 2>&1 &
      KVCACHE_CUDA_FLASH=on timeout 300 python3 -m kvcache.cli conformance --backend cuda --jobs 8 > "$OUT/conf_flash.log" 2>&1
      echo "conformance flash=on rc $?"; grep -a "verdict\|pytest:" "$OUT/conf_flash.log" | tail -3
      awk '/^  Test/ && NF == 5 && $3 != "0" {print "  failed in", $0}' "$OUT/conf_flash.log"; wait
      grep -a "verdict\|pytest:" "$OUT/conf_default.log" | tail -3; tail -3 "$OUT/flash_tests.log"
      grep -a "FAILED\|Error" "$OUT/flash_tests.log" | head -20
      for i in 1 2; do timeout 200 python3 -m kvcache_cuda.bench --only prefill,fp8 2>&1 | grep -a "^prefill\|^fp8\|PASS\|MISS" | tee "$OUT/bench55_$i.log"; done ;;
    fp8values55) section "issue 55 (2026-11-29, thirteenth session): an fp8 ragged call's passes write code * scale for cuDNN; fp8 kernel and flash tests beside the quantized conformance classes with the library on, then the prefill and fp8 bench alone"
      KVCACHE_CUDA_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_flash.py tests/cuda/test_cuda_fp8.py > "$OUT/fp8_tests.log" 2>&1 &
      KVCACHE_CUDA_FLASH=on timeout 300 python3 -m kvcache.cli conformance --backend cuda --jobs 6 -k "Quantized or Numerics or Forward" > "$OUT/conf_fp8.log" 2>&1
      echo "conformance flash=on rc $?"; grep -a "verdict\|pytest:" "$OUT/conf_fp8.log" | tail -3; wait
      tail -2 "$OUT/fp8_tests.log"; grep -a "^FAILED\|Error" "$OUT/fp8_tests.log" | head -20
      for i in 1 2; do timeout 200 python3 -m kvcache_cuda.bench --only prefill,fp8 2>&1 | grep -a "^prefill\|^fp8\|PASS\|MISS" | tee "$OUT/bench_fp8_$i.log"; done ;;
    full55) section "issue 55 (2026-11-29, fourteenth session): the WHOLE conformance matrix (--full, about 1,700 tests) with the library on, in two halves by module (PART=A or B, one call each; about 8 minutes a half in 15 workers)"
      case ${PART:-A} in
        A) K="test_quantized or test_forward or test_graph or test_matrix" ;;
        B) K="not (test_quantized or test_forward or test_graph or test_matrix)" ;;
      esac
      KVCACHE_CUDA_FLASH=on timeout ${FULL_S:-560} python3 -m kvcache.cli conformance --backend cuda --full --jobs ${JOBS:-15} -k "$K" \
        --report "$OUT/conformance_full_${PART:-A}.md" > "$OUT/conformance_full_${PART:-A}.log" 2>&1
      echo "conformance --full part ${PART:-A} rc $?"; grep -a "verdict\|pytest:" "$OUT/conformance_full_${PART:-A}.log" | tail -3
      awk '/^  Test/ && NF == 5 && $3 != "0" {print "  failed in", $0}' "$OUT/conformance_full_${PART:-A}.log"
      grep -a "^FAILED\|^ERROR" "$OUT/conformance_full_${PART:-A}.log" | head -30 ;;
  esac
done
