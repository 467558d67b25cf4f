#!/usr/bin/env bash
# The GPU checks in one script: correctness on CUDA, then speed at real sizes.
#
#   bash benchmarks/gpu.sh          on a machine with a GPU (results under $OUT, default gpu-out)
#   bash benchmarks/gpu.sh --tiny   dry run on the CPU: the same steps on small problems
#
# 1. tests/test_cuda.py: the problem table on CUDA in float64 and float32 against the CPU's
#    float64 results; the bf16 autocast, bf16/fp16-weight and thread tests with CUDA as torch's
#    default device; the whole table on CUDA against brute force there. (The DDP tests need
#    two GPUs for NCCL; they run with gloo on the CPU in CI.)
# 2. benchmarks/gpu_models.py: ResNet-18 (224x224, batch 64) and GPT-2 small (4 x 512 tokens).
# Wheels under .whl (opacus) are installed to /tmp/site first, when there are any.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TINY=0
[ "${1:-}" = "--tiny" ] && TINY=1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no GPU";
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
    | tee "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s; $(grep -E '(passed|failed|error|skipped)' "$OUT/$name.log" | tail -1)" \
        | tee -a "$OUT/summary.txt"
}

PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts= -m 'not slow and not clients'"
if [ $TINY = 1 ]; then
    export BACKPACK_CUDA_CHECK_DEVICE=cpu
    DEV=cpu
    WORKERS=2
    SUBSET=(-k "linear-mlp or conv2d or embedding-tied")
    BENCH=(--tiny --rounds 3)
else
    DEV=cuda
    WORKERS=8
    SUBSET=()
    BENCH=(--rounds 10)
fi

step cuda-vs-cpu 120 bash -c "$PYTEST -n $WORKERS tests/test_cuda.py ${SUBSET[*]@Q}"
step mixed-precision-threads 60 env BACKPACK_TEST_DEFAULT_DEVICE=$DEV bash -c \
    "$PYTEST -n $WORKERS tests/test_half_weights.py tests/test_context.py \
     tests/test_engine_training_loops.py tests/extensions/test_variance_precision.py \
     tests/test_grads_from_samples.py -k 'autocast or half or thread'"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
# tests/test_distributed.py runs gloo processes on the CPU (in CI); NCCL needs two GPUs
echo "distributed: not run here, $GPUS GPU(s) on this machine" | tee -a "$OUT/summary.txt"
for model in resnet18 gpt2; do  # one process each: a device-side assert ends its process
    step "bench-$model" 150 $PY -m benchmarks.gpu_models --device $DEV "${BENCH[@]}" \
        --models $model --out "$OUT/results-$model.md" --profile-dir "$OUT"
done
step table-on-device 90 env BACKPACK_TEST_DEVICE=$DEV bash -c \
    "$PYTEST -n $WORKERS tests/extensions/test_firstorder.py tests/extensions/test_secondorder.py ${SUBSET[*]@Q}"
grep -h "FAILED\|^E  " "$OUT"/*.log | head -40
# at most 8 files come back from a device machine: the logs travel as one archive
tar czf "$OUT/logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm "$OUT"/*.log
cat "$OUT/summary.txt"
