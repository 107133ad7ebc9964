#!/usr/bin/env bash
# One lease of a GPU machine for the paper's scale and analyses, in one call: training
# throughput and MFU on WMT-shaped batches (base and big, bf16 and fp16, the paper's
# 37K vocabulary and ~27-subword sentences), the CUDA tests of fp16 training, Table 3's
# rows trained side by side on the one GPU (`aiayn table3 --jobs`), and Table 1 on the GPU.
# Each step has its own time limit, so that one stuck step leaves the others' results;
# logs, JSON records and a tarball of the sweep's small files go to $OUT (default
# gpu-scale/).
#
#   bash benchmarks/gpu_scale.sh MULTI30K_DIR [TABLE3_STEPS] [TABLE3_JOBS] [TABLE3_LIMIT_S]
#
# Nothing is downloaded: Python packages missing on the machine come as wheels in
# $WHEELS (sacremoses, on the lent machines' image).
set -u
OUT=${OUT:-gpu-scale}
mkdir -p "$OUT"
DATA=$1
STEPS=${2:-2000}
JOBS=${3:-12}
LIMIT=${4:-380}
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
source "$(dirname "$0")/gpu_lease.sh"

step env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
    $PY -c 'import torch; print(\"torch\", torch.__version__, torch.cuda.get_device_name())'
    git log -1 --format='commit %H' 2>/dev/null || true; nproc"

# WMT-shaped batches: 925 sentences of 20-34 subwords (mean 27) a side is ~25,000
# tokens a side, the paper's whole step (25,000 source + 25,000 target) on one GPU.
# 116 sentences (~3,100 tokens a side) is one GPU's share of that step on 8 GPUs.
B="$PY -m aiayn bench train --device cuda --steps 20 --vocab-size 37000 --lengths 20,34 --json"
step bench-train 100 bash -c "
    $B --preset base --dtype bf16,fp16 --batch-sentences 925
    $B --preset base --dtype bf16 --batch-sentences 116
    $B --preset big --dtype bf16,fp16 --batch-sentences 925
    $B --preset big --dtype bf16 --batch-sentences 116" \
    | grep '^{' > "$OUT/bench_train.jsonl"
step bench-compile 70 bash -c "
    $B --preset base --dtype bf16 --batch-sentences 925 --compile" \
    | grep '^{' >> "$OUT/bench_train.jsonl"
cat "$OUT/bench_train.jsonl" >> "$LOG"
step tests-fp16 60 $PY -m pytest -q -rs -p no:cacheprovider tests/fast/test_cuda.py -k "fp16"

# The sweep runs $SWEEP_SRC (e.g. a `git archive` of a commit, carried), not a working
# tree in the middle of changes; by default this tree.
CLEAN=${SWEEP_SRC:-$PWD}
step table3 "$LIMIT" env PYTHONPATH="$CLEAN/src${PYTHONPATH#$PWD/src}" $PY -m aiayn table3 "$CLEAN/configs/table3-multi30k.toml" --data "$DATA" \
    --out /tmp/table3 --device cuda --jobs "$JOBS" --set "train.max_steps=$STEPS" --no-progress
step table3-table 60 env PYTHONPATH="$CLEAN/src${PYTHONPATH#$PWD/src}" $PY -m aiayn table3 "$CLEAN/configs/table3-multi30k.toml" --out /tmp/table3 \
    --set "train.max_steps=$STEPS" --no-train --markdown
(cd /tmp/table3 && tar czf - table3.csv table3.json */seed*/table3_row.json \
    */seed*/train_log.jsonl */seed*/config.json 2>/dev/null) > "$OUT/table3.tgz"

LEFT=$((560 - SECONDS))
if [ "$LEFT" -gt 30 ]; then
    step table1 "$LEFT" $PY -m aiayn table1 --device cuda --d 512 --batch 8 --out /tmp/table1
    cp /tmp/table1/table1.json "$OUT/table1_cuda.json" 2>/dev/null
    cp /tmp/table1/table1.png "$OUT/table1_cuda.png" 2>/dev/null
fi
echo "=== done $(date -u +%T), $SECONDS s" | tee -a "$LOG"
