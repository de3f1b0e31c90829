#!/usr/bin/env bash
# The GPU checks of the Triton split kernel and the CUDA commands, in one run on a CUDA machine.
#   scripts/gpu_check.sh OUTDIR [STEP …]        steps, in this order by default:
#     tune      python -m diffzoo.bench.tune --write: launch configurations for this GPU
#     tests     the kernel tests on CUDA and every test marked gpu (pytest -m gpu)
#     bench     python -m diffzoo.bench: layer, model and profile sections, the Triton kernel against
#               the default SDPA kernel (two_calls) and the baseline, in one run
#     compile   the model section with both towers under torch.compile
#     commands  scripts/gpu_commands.sh: train.sh, a B/16 run, a VLM stage, the eRAM-V bench on CUDA
# Each step is time-boxed (LIMIT_<STEP> seconds) and logged to OUTDIR/gpu_check.log. The results
# (tune.json, launch_configs.json, bench*.json) are copied to OUTDIR after each step, and everything
# else (profiler tables, logs) is packed into OUTDIR/more.tar.gz. WHEELS=DIR installs the wheels in
# DIR first (for a machine whose Python lacks open_clip, webdataset, …) into a private folder.
set -u
if [ $# -lt 1 ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
out=$(realpath -m "$1")
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tune tests bench compile commands)
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=$(mktemp -d)
log="$out/gpu_check.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 NO_ALBUMENTATIONS_UPDATE=1
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
        "$WHEELS"/*.whl >>"$log" 2>&1 || { echo "wheels from $WHEELS did not install" | tee -a "$log"; exit 1; }
    export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

collect() {
    for f in "$work"/tune.json "$work"/bench*.json "$work"/commands/commands.json diffzoo/layers/kernels/launch_configs.json; do
        [ -f "$f" ] && cp "$f" "$out/"
    done
    (cd "$work" && find . -type f -size -4M ! -path './site/*' -print0 | tar czf "$out/more.tar.gz" --null -T -)
}

step() {  # step NAME COMMAND…: run under the step's time limit, log it, collect the results
    local name=$1 limit_var="LIMIT_${1^^}" start rc
    shift
    local limit=${!limit_var:-300}
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$log"
    collect
    return 0
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    "$PY" -c 'import sys, torch, triton, timm, open_clip; print(sys.version.split()[0], torch.__version__, "triton",
triton.__version__, "timm", timm.__version__, "open_clip", open_clip.__version__, torch.cuda.get_device_name())'
} >>"$log" 2>&1

for s in "${steps[@]}"; do
    case "$s" in
    tune)
        step tune "$PY" -m diffzoo.bench.tune --write --out "$work/tune.json" ;;
    tests)
        step tests "$PY" -m pytest -q -rP -p no:cacheprovider -n "${TEST_WORKERS:-4}" \
            tests/layers/test_kernels.py "tests/clip/test_official_checkpoint.py::test_official_outputs_on_cuda_in_fp32_and_with_the_triton_kernel_in_bf16" ;;
    bench)
        step bench "$PY" -m diffzoo.bench --device cuda --sections layer model profile --split-kernel triton \
            --model diffclip-b16 diffclip-b16@two_calls clip-b16-baseline --variants split-fused split-two_calls \
            --tokens 197 577 4096 --causal-tokens 77 --reps 10 --out "$work/bench.json" ;;
    compile)
        step compile "$PY" -m diffzoo.bench --device cuda --sections model --compile --split-kernel triton \
            --model diffclip-b16 clip-b16-baseline --reps 10 --out "$work/bench-compile.json" ;;
    commands)
        step commands bash scripts/gpu_commands.sh "$work/commands" ;;
    *)
        echo "unknown step $s (tune tests bench compile commands)" | tee -a "$log" ;;
    esac
done
echo '--- summary'
grep -E '^=== ' "$log"
awk '/^ +N kernel/{t=1} /^=== /{t=0} t' "$log"
grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)|^gradient cosines|^E  +(AssertionError|assert)' "$log" | tail -40
awk '/^diffzoo.bench on/{b=1} /^=== /{b=0} b' "$log" | grep -v '^  n/a'
