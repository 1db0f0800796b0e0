#!/usr/bin/env bash
# A/B of the serving bench's engine row on one GPU: the working tree against an older tree,
# alternated (new, old, new, old), in one call to a lent machine. Locally, first:
#   git archive <old commit> | (mkdir -p .ab/old && tar -x -C .ab/old)
# (.ab is ignored: the call carries it; delete it before running the tests.)
# ARGS: the bench's arguments (default: the engine row alone, B=64, the serving Llama).
set -u
ARGS=${ARGS:---serving --model llama --skip b,c --no-busy}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda 2>&1 | grep -v -i warn | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
# ROUNDS: how many (new, old) pairs (default 2)
for run in $(for _ in $(seq ${ROUNDS:-2}); do echo new old; done); do
  echo "=================== $run ($(date +%T))"
  if [ "$run" = old ]; then
    # from inside the old tree: `python -m` puts the working folder first on the path
    (cd .ab/old && PYTHONPATH=$PWD:$PWD/backends/cuda timeout 280 python3 -m kvcache.cli bench $ARGS 2>&1 | grep -a -v -i warn | tail -${TAIL:-12})
  else
    timeout 280 python3 -m kvcache.cli bench $ARGS 2>&1 | grep -a -v -i warn | tail -${TAIL:-12}
  fi
done
