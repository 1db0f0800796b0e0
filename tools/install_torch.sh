#!/usr/bin/env bash
# Installs torch into a Python environment for the Makefile (`make test`, `make demo`) and says
# which build it took. Usage:
#     tools/install_torch.sh PYTHON cpu       # the CPU build ($TORCH) or nothing (make test)
#     tools/install_torch.sh PYTHON prefer    # the CPU build where it can be had, else the
#                                             # registry's default torch (make demo without a GPU)
#     tools/install_torch.sh PYTHON gpu       # the registry's default torch (the CUDA build on
#                                             # Linux) and Triton, for the cuda backend (make demo
#                                             # where nvidia-smi answers)
#     tools/install_torch.sh PYTHON auto      # `gpu` where nvidia-smi -L answers, else `prefer`
# The CPU build is named by its local version label ($TORCH, default torch==2.13.0+cpu): pip takes
# it from a wheel on disk (pip's find-links) or from an index that has it (TORCH_INDEX, e.g.
# https://download.pytorch.org/whl/cpu, added with --extra-index-url). The public registry has no
# `+cpu` build: there `prefer` falls back to plain `torch` (on Linux a CUDA build of several GB,
# which runs on the CPU too) and says so; `cpu` fails at once, naming TORCH_INDEX.
# PIP (default "PYTHON -m pip") is the pip command line, so that a test can put another in.
set -euo pipefail
usage() { echo "usage: tools/install_torch.sh PYTHON cpu|prefer|gpu|auto" >&2; exit 2; }
[ $# -eq 2 ] || usage
PYTHON=$1 MODE=$2
case $MODE in cpu|prefer|gpu|auto) ;; *) usage ;; esac
TORCH=${TORCH:-torch==2.13.0+cpu}
TORCH_INDEX=${TORCH_INDEX:-}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
read -r -a PIP_CMD <<< "${PIP:-$PYTHON -m pip}"
INDEX=()
[ -z "$TORCH_INDEX" ] || INDEX=(--extra-index-url "$TORCH_INDEX")
say() { echo "install_torch: $*"; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# pip -qq: -q still prints a warning for every package that one of a machine's extra indexes lacks;
# --no-compile: Python writes the .pyc of what it imports when it first does (byte-compiling all
# of torch at install time took more than half of its install here)
pip_install() { "${PIP_CMD[@]}" install -qq --no-compile "${INDEX[@]}" "$@" >"$log" 2>&1; }

# what went in, read back from the environment (a GPU build names its CUDA or HIP version)
report() {
    "$PYTHON" -c 'import torch; v = torch.version
kind = f"CUDA {v.cuda} build" if v.cuda else f"ROCm {v.hip} build" if getattr(v, "hip", None) else "CPU build"
print(f"install_torch: installed torch {torch.__version__} ({kind})")' 2>/dev/null \
        || say "installed (torch does not import in $PYTHON yet)"
}

if [ "$MODE" = auto ]; then
    if "$NVIDIA_SMI" -L >/dev/null 2>&1; then MODE=gpu; else MODE=prefer; fi
fi
if [ "$MODE" = gpu ]; then
    say "for the GPU (nvidia-smi): the registry's default torch (the CUDA build) and Triton, for the cuda backend"
    pip_install torch triton || { cat "$log" >&2; exit 1; }
    report
    exit 0
fi

source="a local wheel or the indexes pip is set up with"
[ -z "$TORCH_INDEX" ] || source="TORCH_INDEX=$TORCH_INDEX"
say "the CPU build $TORCH, from $source"
if pip_install "$TORCH"; then
    report
    exit 0
fi
# only a build that no index has falls back (pip says so); another failure (a disk, a broken
# wheel) stops here with pip's output
if ! grep -qE "No matching distribution found|Could not find a version that satisfies" "$log"; then
    cat "$log" >&2
    exit 1
fi
if [ "$MODE" = cpu ]; then
    cat "$log" >&2
    echo "install_torch: no index has $TORCH: point pip at one that has the CPU build," \
         "e.g. make test TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
    exit 1
fi
say "$TORCH is not to be had here (the public registry has no +cpu build; TORCH_INDEX=https://download.pytorch.org/whl/cpu names one)"
say "taking the registry's default torch instead (on Linux a CUDA build, several GB; it runs on the CPU too)"
pip_install torch || { cat "$log" >&2; exit 1; }
report
