#!/usr/bin/env bash
# The project's commands on one CUDA GPU, in one job of about 250 s (no network, nothing downloaded):
#   0. environment, package versions, nvidia-smi, a one-process all_reduce over NCCL
#   1. scripts/train.sh diffclip-tiny on a small synthetic webdataset corpus, on the GPU (one process)
#   2. scripts/train.sh diffclip-b16-cc3m and clip-b16-baseline-cc3m on synthetic shards, one after the
#      other: images/s per GPU of each and their ratio, as `python -m diffzoo.bench --sections train`
#      (diffzoo/bench/end_to_end.py) measures them
#   3. one VLM fine-tuning stage: python -m diffzoo.train.vlm --recipe paligemma-3b-vqav2-diff on a tiny
#      random PaliGemma and a generated VQAv2-layout set (the command's main, run by
#      scripts/gpu_commands_helper.py vlm, which then records the device it trained on)
#   4. python -m diffzoo.bench.eramv --model diffclip-b16 LM_DIR --device cuda: FLOPs, forward latency, time
#      to first token and tokens/s, with a random local Gemma
#
#   scripts/gpu_commands.sh OUTDIR                 (from anywhere; runs in the repository root)
#   DEVICE=cpu scripts/gpu_commands.sh OUTDIR      the same commands on the CPU at tiny sizes (a dry run)
#
# OUTDIR receives two files: commands.log (every step's output, in order) and commands.json (per step:
# command, exit status, seconds, timeout; and what each step measured). Every step runs under `timeout`;
# a step that fails or times out is recorded and the next one runs. Steps share a deadline (BUDGET_S,
# default 250 s on CUDA): a step's timeout is cut so that the steps after it keep their share, and a step
# with no time left is skipped and recorded as such. Scratch files go to WORK (default: a new directory
# under TMPDIR, removed at the end unless KEEP_WORK=1).
#
# Settings (environment): PYTHON (default python3), DEVICE (cuda | cpu), BUDGET_S, B16_BATCH, B16_STEPS,
# B16_WORKERS, B16_IMAGE_SIZE, B16_RECIPES ("DIFFERENTIAL BASELINE"), CORPUS_PROCESSES, WORK, KEEP_WORK.
set -uo pipefail

if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

PY="${PYTHON:-python3}"
export PYTHON="$PY"                              # scripts/train.sh starts torchrun with it
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export NO_ALBUMENTATIONS_UPDATE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
DEVICE="${DEVICE:-cuda}"
HELPER="scripts/gpu_commands_helper.py"
read -r B16_DIFF B16_BASE <<< "${B16_RECIPES:-diffclip-b16-cc3m clip-b16-baseline-cc3m}"
VLM_RECIPE=paligemma-3b-vqav2-diff

if [ "$DEVICE" = cuda ]; then
    # Step 2's size. A B/16 training step at batch 256 in bf16 takes about 0.17 s (diffclip-b16) and 0.14 s
    # (clip-b16-baseline) on an H100 or H200, the model alone (bench/results), and each train.sh run spends
    # ~13 s besides its steps (torchrun and imports, model, CUDA and loader start-up, exit). At 8 workers
    # decoding 128 px scenes the loader fed ~1,200-1,500 images/s (55-67 % of each step waiting on data,
    # bench/results/cuda-NVIDIA-H200-2026-11-26/commands-128px.json); 14 workers of 64 px scenes
    # (RandomResizedCrop still gives the model 224 px) feed about as many (54 % and 65 %, commands.json):
    # the per-sample transforms, not decoding, bound a 16-core machine, and summary's loader_bound says so.
    # 112 steps per recipe (8 per worker) fit beside the other steps in ~250 s; the first 5 steps are left
    # out of the images/s medians. B16_STEPS (a multiple of B16_WORKERS) sets another length.
    BUDGET_S="${BUDGET_S:-250}"
    B16_BATCH="${B16_BATCH:-256}"
    B16_STEPS="${B16_STEPS:-112}"
    B16_WORKERS="${B16_WORKERS:-14}"
    B16_IMAGE_SIZE="${B16_IMAGE_SIZE:-64}"
    B16_PRECISION=()                             # the recipes' amp_bf16
    B16_WARMUP=5                                 # steps left out of the images/s medians
    TINY_SCENES=1024                             # diffclip-tiny: 2 epochs of 32 steps at batch 32
    VLM_SIZE=(--max_steps 48 --log_every 8 --save_every 48)
    LM_SIZE=(--lm-hidden 512 --lm-layers 8)
    ERAMV_VISION=(--model diffclip-b16 "__LM__")  # 196 patches, 64 anchors (eRAM-V's)
    NEW_TOKENS=32
else
    BUDGET_S="${BUDGET_S:-900}"
    B16_BATCH="${B16_BATCH:-4}"
    B16_STEPS="${B16_STEPS:-4}"
    B16_WORKERS="${B16_WORKERS:-2}"
    B16_PRECISION=(--precision fp32)             # bf16 autocast on a CPU only slows the dry run down
    B16_WARMUP=1
    TINY_SCENES=256
    VLM_SIZE=(--max_steps 8 --log_every 4 --save_every 8 --precision fp32)
    LM_SIZE=(--lm-hidden 48 --lm-layers 4)
    ERAMV_VISION=(--model diffclip-tiny "__LM__" --anchors 16)  # 64 patches
    NEW_TOKENS=8
fi
B16_IMAGE_SIZE="${B16_IMAGE_SIZE:-128}"          # RandomResizedCrop scales it to 224, as the recipes do
NCPU=$(nproc 2>/dev/null || echo 4)
CORPUS_PROCESSES="${CORPUS_PROCESSES:-$(( NCPU > 12 ? 10 : (NCPU > 2 ? NCPU - 2 : 1) ))}"

# The B/16 corpus: every data worker reads 2 shards of its own and yields B16_STEPS / B16_WORKERS whole
# batches, so one epoch is exactly B16_STEPS steps (open_clip_train drops partial batches).
if (( B16_STEPS % B16_WORKERS || B16_BATCH % 2 )); then
    echo "B16_STEPS ($B16_STEPS) must be a multiple of B16_WORKERS ($B16_WORKERS), B16_BATCH even" >&2
    exit 2
fi
B16_SHARDS=$(( 2 * B16_WORKERS ))
B16_PER_SHARD=$(( B16_STEPS / B16_WORKERS * B16_BATCH / 2 ))
B16_SAMPLES=$(( B16_SHARDS * B16_PER_SHARD ))

if [ -z "${WORK:-}" ]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/diffzoo-gpu-commands.XXXXXX") || exit 2
fi
mkdir -p "$WORK/runs" || exit 2
LOG="$OUT/commands.log"
STEPS="$WORK/steps.tsv"
rm -f "$OUT/commands.json"
: > "$LOG"
: > "$STEPS"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T0=$(now)

# steps_json STATUS: commands.json from steps.tsv alone (after every step, so that a job stopped from outside
# leaves its record; the summary at the end replaces it with the full one)
steps_json() {
    {
        printf '{"device": "%s", "elapsed_s": %s, "status": "%s", "steps": [' "$DEVICE" "$(since "$T0")" "$1"
        awk -F'\t' 'BEGIN { ORS = "" } { gsub(/"/, "\\\"", $5); if (NR > 1) print ", ";
            printf "{\"step\": \"%s\", \"rc\": \"%s\", \"seconds\": \"%s\", \"timeout_s\": \"%s\", " \
                   "\"command\": \"%s\"}", $1, $2, $3, $4, $5 }' "$STEPS"
        printf ']}\n'
    } > "$OUT/commands.json.tmp" && mv "$OUT/commands.json.tmp" "$OUT/commands.json"
}

{
    commit=$(git rev-parse --short HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null || commit+=' (modified)'; }
    echo "diffzoo: the commands on $DEVICE, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit ${commit:-unknown}"
    echo "budget ${BUDGET_S} s; B/16: batch $B16_BATCH, $B16_STEPS steps, $B16_WORKERS workers," \
         "$B16_SAMPLES scenes of ${B16_IMAGE_SIZE} px in $B16_SHARDS shards; work $WORK"
} | tee -a "$LOG"

# run_step NAME LIMIT RESERVE CMD…: CMD under `timeout` (LIMIT seconds, cut so that RESERVE seconds of the
# budget stay for the steps after it); its output to WORK/NAME.log and commands.log; a line in steps.tsv.
run_step() {
    local name="$1" limit="$2" reserve="$3"
    shift 3
    local left=$(( BUDGET_S - SECONDS - reserve ))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        printf '%s\tskipped\t\t\t%s\n' "$name" "$*" >> "$STEPS"
        steps_json running
        printf '=== %s: skipped, %s s of the budget left\n' "$name" "$(( BUDGET_S - SECONDS ))" | tee -a "$LOG"
        return 0
    fi
    printf '=== %s (timeout %s s): %s\n' "$name" "$limit" "$*" >> "$LOG"
    local start rc seconds
    start=$(now)
    timeout -k 15 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    seconds=$(since "$start")
    cat "$WORK/$name.log" >> "$LOG"
    printf '=== %s: exit %s, %s s\n\n' "$name" "$rc" "$seconds" >> "$LOG"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$limit" "$*" >> "$STEPS"
    steps_json running
    printf '%-32s exit %3s  %6s s\n' "$name" "$rc" "$seconds"
    if [ "$rc" != 0 ]; then
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "  timed out after $limit s"
        tail -n 6 "$WORK/$name.log" | cut -c1-300 | sed 's/^/  | /'
    fi
    return 0
}

# start_bg NAME LIMIT CMD…: CMD under `timeout` in the background (CPU work that overlaps GPU steps);
# wait_bg NAME records it as run_step does, once it has finished.
declare -A BG_PID BG_LIMIT BG_CMD
start_bg() {
    local name="$1" limit="$2"
    shift 2
    (
        start=$(now)
        timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
        rc=$?
        printf '%s\t%s\n' "$rc" "$(since "$start")" > "$WORK/$name.rc"
    ) &
    BG_PID[$name]=$!
    BG_LIMIT[$name]=$limit
    BG_CMD[$name]="$*"
}
wait_bg() {
    local name="$1" rc seconds
    wait "${BG_PID[$name]}"
    read -r rc seconds < "$WORK/$name.rc" || { rc=1; seconds=; }
    {
        printf '=== %s (background, timeout %s s): %s\n' "$name" "${BG_LIMIT[$name]}" "${BG_CMD[$name]}"
        cat "$WORK/$name.log"
        printf '=== %s: exit %s, %s s\n\n' "$name" "$rc" "$seconds"
    } >> "$LOG"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "${BG_LIMIT[$name]}" "${BG_CMD[$name]}" >> "$STEPS"
    steps_json running
    printf '%-32s exit %3s  %6s s  (background)\n' "$name" "$rc" "$seconds"
    if [ "$rc" != 0 ]; then tail -n 6 "$WORK/$name.log" | cut -c1-300 | sed 's/^/  | /'; fi
}

# CPU work for steps 1-3, started now so that it overlaps the steps before the ones that need it
start_bg 1-corpus-tiny 30 "$PY" -m diffzoo.data synthetic "$WORK/tiny" --train "$TINY_SCENES" --val 32 \
    --image-size 64 --per-shard 128
start_bg 2-corpus 90 "$PY" "$HELPER" corpus "$WORK/b16" --train "$B16_SAMPLES" --per-shard "$B16_PER_SHARD" \
    --image-size "$B16_IMAGE_SIZE" --processes "$CORPUS_PROCESSES"
start_bg 3-assets 90 "$PY" "$HELPER" assets "$WORK/assets" "${LM_SIZE[@]}"

# 0. environment and NCCL (gloo on CPU)
run_step 0-env 40 200 env NCCL_DEBUG=INFO "$PY" "$HELPER" env "$WORK/env.json" --device "$DEVICE"

# 1. scripts/train.sh diffclip-tiny, one process, on the GPU (the recipe says cpu: --device overrides it).
#    commands.json records the device and the process group its out.log names: open_clip_train makes no
#    process group for a world of one (WORLD_SIZE=1), so NCCL carries nothing here and step 0's all_reduce
#    is the NCCL check; NCCL_DEBUG=INFO would show any communicator in the log.
wait_bg 1-corpus-tiny
run_step 1-train-tiny 60 180 env NPROC_PER_NODE=1 NCCL_DEBUG=INFO bash scripts/train.sh diffclip-tiny \
    --device "$DEVICE" --train_data "$WORK/tiny/train" --logs "$WORK/runs" --name diffclip-tiny --workers 2

# 2. diffclip-b16 against clip-b16-baseline: scripts/train.sh with the flags diffzoo/bench/end_to_end.py
#    passes (one epoch, one process, log every step, no checkpoints), and no tensorboard
wait_bg 2-corpus
b16_train() {  # RECIPE LIMIT RESERVE
    run_step "2-train-$1" "$2" "$3" env NPROC_PER_NODE=1 CC3M_SHARDS="$WORK/b16/train" bash scripts/train.sh "$1" \
        --train_data "$WORK/b16/train" --epochs 1 --logs "$WORK/runs-b16" --name "$1" \
        --global_batch_size "$B16_BATCH" --max_batch_per_gpu "$B16_BATCH" --warmup_epochs 0 \
        --workers "$B16_WORKERS" --log_every_n_steps 1 --save_frequency 0 --save_most_recent false \
        --resume null --report_to none "${B16_PRECISION[@]}"
}
b16_train "$B16_DIFF" 70 120
b16_train "$B16_BASE" 60 70

# 3. one VLM fine-tuning stage (LoRA + λ on a differential decoder, VQA accuracy on the val split)
wait_bg 3-assets
run_step 3-vlm 90 30 env PALIGEMMA_DIR="$WORK/assets/paligemma" VQAV2_DIR="$WORK/assets/vqav2" \
    "$PY" "$HELPER" vlm "$WORK/vlm-device.json" -- --recipe "$VLM_RECIPE" --output "$WORK/vlm" \
    --report_to none --workers 2 --batch_size 8 --data.fraction 1.0 --data.val_fraction 1.0 \
    --eval_max_new_tokens 3 --device "$DEVICE" "${VLM_SIZE[@]}"

# 4. eRAM-V against the full-token model: FLOPs, forward latency, time to first token, tokens/s
ERAMV_ARGS=("${ERAMV_VISION[@]/__LM__/$WORK/assets/lm}")
run_step 4-eramv 60 8 "$PY" -m diffzoo.bench.eramv "${ERAMV_ARGS[@]}" --device "$DEVICE" \
    --new-tokens "$NEW_TOKENS" --out "$WORK/eramv.json"

# commands.json and the table
TOTAL=$(since "$T0")
echo "=== summary" >> "$LOG"
timeout -k 5 30 "$PY" "$HELPER" summary "$WORK" "$OUT/commands.json" --device "$DEVICE" \
    --b16-recipes "$B16_DIFF" "$B16_BASE" --vlm-recipe "$VLM_RECIPE" --warmup "$B16_WARMUP" \
    --budget "$BUDGET_S" --total "$TOTAL" --setting "b16_batch=$B16_BATCH" --setting "b16_steps=$B16_STEPS" \
    --setting "b16_workers=$B16_WORKERS" --setting "b16_scenes=$B16_SAMPLES" \
    --setting "b16_image_size=$B16_IMAGE_SIZE" --setting "b16_warmup_steps=$B16_WARMUP" \
    --setting "tiny_scenes=$TINY_SCENES" --setting "eramv_new_tokens=$NEW_TOKENS" 2>&1 | tee -a "$LOG"
if ! grep -q '"status": "complete"' "$OUT/commands.json" 2>/dev/null; then
    steps_json "summary failed"  # the step records alone
    column -t -s $'\t' "$STEPS" 2>/dev/null | cut -c1-120 || cat "$STEPS"
fi
echo "total $(since "$T0") s; $OUT/commands.log, $OUT/commands.json"
if [ "${KEEP_WORK:-0}" != 1 ]; then rm -rf "$WORK"; fi
