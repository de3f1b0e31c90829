#!/usr/bin/env bash
# Train a recipe with torchrun through open_clip_train's loop, on one node or many.
#   scripts/train.sh RECIPE [--key value …] [-- open_clip_train flags]
#   scripts/train.sh diffclip-b16-cc3m                         (CC3M_SHARDS=/data/cc3m)
#   scripts/train.sh diffclip-tiny --train_data shards --logs /runs -- --seed 1
#
# One node:   NPROC_PER_NODE processes (default: one per GPU, 1 without a GPU).
# Many nodes: the same command on every node, with NNODES and either
#             NODE_RANK, MASTER_ADDR, MASTER_PORT   (static: MASTER_ADDR is node 0), or
#             RDZV_ENDPOINT=host:port [RDZV_ID=job] (c10d rendezvous, nodes in any order).
# SLURM: scripts/slurm/train.sbatch. PYTHON chooses the interpreter (default: the project's .venv, which
# `make demo` / `make test` build, when no virtual environment is active; else python on PATH).
# Re-running the same command resumes the run from its last checkpoint.
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
recipe="$1"
shift
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
if [ -z "${PYTHON:-}" ] && [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$venv" ]; then
    PYTHON="$venv"
fi
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"

if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
launch=(--nproc-per-node "$NPROC_PER_NODE")
NNODES="${NNODES:-1}"
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    launch+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
             --rdzv-id "${RDZV_ID:-diffzoo-$recipe}")
elif [ "$NNODES" != 1 ]; then
    : "${NODE_RANK:?set NODE_RANK (0 … NNODES-1) on each node, or RDZV_ENDPOINT}"
    : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, or RDZV_ENDPOINT}"
    launch+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
             --master-port "${MASTER_PORT:-29500}")
elif [ -n "${MASTER_PORT:-}" ]; then
    launch+=(--nnodes 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
    launch+=(--standalone)  # one node, a free port chosen by torchrun
fi

# torchrun (`python -m diffzoo.train torchrun`), exiting with the training's own status: a failed run ends on its
# `error:` line, not on torchrun's report of it. After `--` torchrun parses nothing, so the recipe's flags arrive intact.
exec "$PYTHON" -m diffzoo.train torchrun "${launch[@]}" -- --recipe "$recipe" "$@"
