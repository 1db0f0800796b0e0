#!/usr/bin/env bash
# The two-GPU runs of docs/distributed.md in one go (on a lent nvidia-h100-x2 / nvidia-h200-x2,
# from the repo root): install, the machine's link, the transfer bench and lab, the tp CLI, the
# disaggregated demo. STEPS picks sections; logs land in $OUT (or ./gpu-out).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
section() { echo; echo "=================== $1 ($(date +%T))"; }
section "setup"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda 2>&1 | grep -v -i warning | tail -3
for step in ${STEPS:-link transfer runahead tpbench tp disagg}; do
  case $step in
    link) section "how the GPUs are linked"
      nvidia-smi topo -m 2>&1 | head -8 ;;
    lab) section "tools/transfer_lab.py: where a transfer's time goes; host tier against pinned copies"
      timeout 300 python3 tools/transfer_lab.py ${LAB_ARGS:-} 2>&1 | grep -a -v -i warn | tee "$OUT/transfer_lab.log" | tail -150 ;;
    transfer) section "kvcache bench --transfer"
      timeout 300 python3 -m kvcache.cli bench --transfer ${TRANSFER_ARGS:-} 2>&1 | grep -a -v -i warn | tee "$OUT/transfer.log" | tail -30 ;;
    runahead) section "cross-process run-ahead: transfers queued behind forwards, outputs read at the end, against one GPU"
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_two_gpu_run_ahead.py 2>&1 | grep -a -v -i warn | tail -5 ;;
    tpbench) section "kvcache bench --serving --workload tp (TP=1 against TP=2, 8B shapes, 32 layers, B=64)"
      timeout ${TPBENCH_TIMEOUT:-300} python3 -m kvcache.cli bench --serving --workload tp ${TPBENCH_ARGS:-} > "$OUT/tpbench.log" 2>&1
      echo "rc $?"; grep -a -m3 "Error:" "$OUT/tpbench.log"; grep -a -v -i warn "$OUT/tpbench.log" | tail -8 ;;
    tp) # TP_RUNS: argument sets separated by ';' (default: the small Llama, the 8B shape in float32 and in bfloat16)
      IFS=';' read -ra runs <<< "${TP_RUNS:- ;--shape 8b --dtype bfloat16;--shape 8b}"
      for i in "${!runs[@]}"; do
        section "tp CLI: torchrun --standalone --nproc-per-node=2 -m kvcache.integrations.tp --backend cuda --check ${runs[$i]}"
        timeout ${TP_TIMEOUT:-200} torchrun --standalone --nproc-per-node=2 -m kvcache.integrations.tp --backend cuda --check ${runs[$i]} > "$OUT/tp$i.log" 2>&1
        echo "rc $?"; grep -a -m3 "Error:" "$OUT/tp$i.log"; grep -a -v -i warn "$OUT/tp$i.log" | grep -a -v "^\s*$" | tail -12
      done ;;
    disagg) section "kvcache demo --disaggregate --device cuda ${DISAGG_ARGS:-}"
      timeout 400 python3 -m kvcache.cli demo --disaggregate --device cuda ${DISAGG_ARGS:-} 2>&1 | grep -a -v -i warn | tee "$OUT/disagg.log" | tail -30 ;;
  esac
done
