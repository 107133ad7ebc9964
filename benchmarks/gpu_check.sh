#!/usr/bin/env bash
# One lease of a GPU machine, in one call: the CUDA tests, the base model's training
# throughput and MFU, decoding, the side-by-side with HF Marian, and a short run of the
# En->De recipe on the GPU. Each step has its own time limit, so that one stuck step
# leaves the others' results; logs and JSON records go to $OUT (default: gpu-check/).
#
#   bash benchmarks/gpu_check.sh [MULTI30K_DIR]
#
# MULTI30K_DIR holds Multi30k's files (train/val/test_2016_flickr .en/.de .gz); without it
# the recipe step is skipped. Nothing is downloaded: a missing Python package (e.g.
# sacremoses on an image without it) can be given as wheels in $WHEELS.
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
DATA=${1:-}
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
source "$(dirname "$0")/gpu_lease.sh"

step env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
    $PY -c 'import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name())'
    git log -1 --format='commit %H' 2>/dev/null || true"
step tests 150 $PY -m pytest -q -rs -p no:cacheprovider tests/fast/test_cuda.py tests/fast/test_kernels.py
step bench-train 120 bash -c "
    $PY -m aiayn bench peak --dtype bf16,fp32 --device cuda --json
    $PY -m aiayn bench train --preset base --dtype bf16 --device cuda --batch-sentences 1700 --steps 20 --json
    $PY -m aiayn bench train --preset base --dtype bf16 --device cuda --batch-sentences 291 --steps 20 --json
    $PY -m aiayn bench train --preset base --dtype fp32 --device cuda --batch-sentences 1700 --steps 20 --json" \
    | grep '^{' > "$OUT/bench_train.jsonl"
cat "$OUT/bench_train.jsonl" >> "$LOG"
step bench-decode 60 bash -c "
    $PY -m aiayn bench decode --preset base --beam 4 --out-len 20 --dtype bf16 --device cuda --json
    $PY -m aiayn bench decode --preset base --beam 1 --out-len 20 --dtype bf16 --device cuda --json" \
    | grep '^{' > "$OUT/bench_decode.jsonl"
cat "$OUT/bench_decode.jsonl" >> "$LOG"
step compare 130 $PY benchmarks/compare.py --device cuda --presets base --what train --dtypes bf16 \
    --hf-attn eager,sdpa --ct2 '' --steps 20 --batch-sentences 1700 --json "$OUT/compare.jsonl"
if [ -n "$DATA" ]; then
    step recipe 200 $PY -m aiayn recipe configs/multi30k-en-de.toml --data "$DATA" \
        --out /tmp/aiayn-recipe --device cuda --no-progress --set train.max_steps=300 \
        --set train.max_minutes=3
    cp /tmp/aiayn-recipe/results.json "$OUT/recipe_results.json" 2>/dev/null
    cp /tmp/aiayn-recipe/train_log.jsonl "$OUT/recipe_train_log.jsonl" 2>/dev/null
fi
echo "=== done $(date -u +%T)" | tee -a "$LOG"
