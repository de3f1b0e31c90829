#!/usr/bin/env bash
# Conceptual Captions 3M -> webdataset shards (shorter side 224 px) with img2dataset.
#   scripts/download_cc3m.sh Train_GCC-training.tsv OUT_DIR [--extend] [-- img2dataset flags]
# The TSV (caption<TAB>url, no header) comes from https://ai.google.com/research/ConceptualCaptions/download.
# IMG2DATASET_PROCESSES (default: CPU cores), IMG2DATASET_THREADS (default 64), WANDB=1 for wandb.
# Safe to re-run: finished shards are kept. Card: data/cc3m.yaml.
set -euo pipefail
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PYTHON" -m diffzoo.data download cc3m "$@"
