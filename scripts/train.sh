#!/usr/bin/env bash
# Train a recipe through open_clip_train's loop, on one node or many.
#   scripts/train.sh RECIPE [--key value …] [-- open_clip_train flags]      (starts torchrun itself)
#   torchrun [torchrun flags] scripts/train.sh -- RECIPE [--key value …] [-- open_clip_train flags]
#   scripts/train.sh diffclip-b16-cc3m                         (CC3M_SHARDS=/data/cc3m)
#   scripts/train.sh diffclip-tiny --train_data shards --logs /runs -- --seed 1
#   torchrun --nproc-per-node 8 scripts/train.sh -- diffclip-b16-cc3m --logs /runs
#
# The `--` after scripts/train.sh keeps torchrun from reading the recipe's flags as its own (it refuses
# `--logs` as a prefix of its `--logs-specs`). torchrun --no-python runs the script with bash, the same way.
# Started by scripts/train.sh itself: NPROC_PER_NODE processes (default: one per GPU, 1 without a GPU);
# many nodes: the same command on every node, with NNODES and either NODE_RANK, MASTER_ADDR, MASTER_PORT
# (static: MASTER_ADDR is node 0), or RDZV_ENDPOINT=host:port [RDZV_ID=job] (c10d, nodes in any order).
# SLURM: scripts/slurm/train.sbatch. PYTHON chooses the interpreter (default: the project's .venv, which
# `make demo` / `make test` build, when no virtual environment is active; else python on PATH; under
# torchrun without --no-python, torchrun's). Re-running the same command resumes the run from its last checkpoint.
''':'
# Bash reads this part; Python reads it as a string and runs the part after it (torchrun's default).
set -euo pipefail
usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}
rank="${TORCHELASTIC_RUN_ID:+${RANK:-0}}"  # set in a process torchrun started
if [ "${1:-}" = "--" ]; then
    shift  # the `--` that keeps torchrun from reading what follows
fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    if [ "${rank:-0}" = 0 ]; then usage; fi
    exit 0
fi
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    if [ "${rank:-0}" = 0 ]; then
        if [ $# -ge 1 ]; then
            echo "error: scripts/train.sh: '$1' where the recipe should be; the recipe comes first, after at" \
                 "most one '--' (torchrun [torchrun flags] scripts/train.sh -- RECIPE [--key value …])" >&2
        fi
        usage >&2
    fi
    exit 2
fi
recipe="$1"
shift
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
if [ -z "${PYTHON:-}" ] && [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$venv" ]; then
    PYTHON="$venv"
fi
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"

if [ -n "$rank" ]; then
    # One process of a torchrun job (torchrun … scripts/train.sh): it trains, as python -m diffzoo.train does
    # in every process of the job scripts/train.sh starts below.
    exec "$PYTHON" -u -m diffzoo.train --recipe "$recipe" "$@"
fi

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
# `error:` line, not on torchrun's report of it. After `--` torchrun parses nothing: the recipe's flags arrive intact.
exec "$PYTHON" -m diffzoo.train torchrun "${launch[@]}" -- --recipe "$recipe" "$@"
':'''
# Python reads from here (bash never does: it ran exec above). torchrun runs this file as `python -u
# scripts/train.sh ARGS` in each process it starts; the process runs the bash part above with this interpreter,
# which sees torchrun's variables and trains the process's rank. To Python the next two lines do nothing; to a
# bash parser (bash -n) the second starts a here-document that the file's last line ends.
true = 0
true << 0
import os
import sys

os.environ['PYTHON'] = sys.executable
os.execvp('bash', ['bash', __file__, *sys.argv[1:]])
0
