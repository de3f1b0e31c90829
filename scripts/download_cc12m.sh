#!/usr/bin/env bash
# Conceptual 12M -> webdataset shards (shorter side 224 px) with img2dataset.
#   scripts/download_cc12m.sh cc12m.tsv OUT_DIR [--extend] [-- img2dataset flags]
# The TSV (url<TAB>caption, no header) comes from https://github.com/google-research-datasets/conceptual-12m.
# IMG2DATASET_PROCESSES (default: CPU cores), IMG2DATASET_THREADS (default 64), WANDB=1 for wandb.
# Safe to re-run: finished shards are kept. Card: data/cc12m.yaml.
set -euo pipefail
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PYTHON" -m diffzoo.data download cc12m "$@"
