#!/usr/bin/env bash
# One lease of a GPU machine for the parser (issue 70): candidate settings of the parsing
# recipe x 3 seeds, all side by side on the one GPU (one process each), each trained for
# TRAIN_MIN minutes, tuned on dev, parsing the test set constrained and unconstrained;
# then each run's dev-F1 curve over its checkpoints and the test F1 of the checkpoint
# with the best dev F1 (scripts/parse_curve.py). Into $OUT: log.txt, summary.json (one
# record per run), runs.tar.gz (each run's results.json, train_log.jsonl, curve.json, log).
#
#   DATA=treebank.zip [EVALB=dir] [DEVICE=cuda] [TRAIN_MIN=3.2] [SEEDS="1 2 3"] \
#       [CANDS="base d256 drop01 batch16k"] [EXTRA="--set ..."] bash benchmarks/gpu_parse.sh
set -u
OUT=${OUT:-gpu-parse}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DATA=${DATA:?DATA: the treebank sample (treebank.zip)}
EVALB=${EVALB:-}
DEVICE=${DEVICE:-cuda}
TRAIN_MIN=${TRAIN_MIN:-3.2}
SEEDS=${SEEDS:-"1 2 3"}
CANDS=${CANDS:-"base d256 drop01 batch16k"}
EXTRA=${EXTRA:-}
RECIPE_LIMIT=${RECIPE_LIMIT:-420}  # seconds for a whole recipe (training, tuning, test)
CURVE_LIMIT=${CURVE_LIMIT:-75}
CURVE_EVERY=${CURVE_EVERY:-5}
RUNS=${RUNS:-/tmp/parse-runs}
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RUNS"
summarise() { $PY benchmarks/parse_summary.py "$RUNS" "$OUT/summary.json" 2>&1 | tee -a "$LOG"; }

cand_args() {
    case $1 in
    base) echo "" ;;
    d256) echo "--set d_model=256 --set d_ff=1024 --set d_k=64 --set d_v=64" ;;
    drop01) echo "--set P_drop=0.1" ;;
    batch16k) echo "--set train.max_tokens=16384" ;;
    warm4k) echo "--set warmup_steps=4000 --set lr_scale=2" ;;
    *) echo "unknown candidate $1" >&2; exit 2 ;;
    esac
}

{
    date -u +"start %T"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'
    command -v gcc cc || echo "no C compiler"
    nproc
} 2>&1 | tee -a "$LOG"

evalb_set=(--set "recipe.evalb=$EVALB")
for c in $CANDS; do
    for s in $SEEDS; do
        run="$RUNS/$c-s$s"
        # shellcheck disable=SC2046
        OMP_NUM_THREADS=1 timeout -k 10 "$RECIPE_LIMIT" $PY -m aiayn recipe \
            configs/ptb-sample-parse.toml --data "$DATA" --out "$run" --device "$DEVICE" \
            --seed "$s" --no-progress "${evalb_set[@]}" \
            --set train.max_minutes="$TRAIN_MIN" --set train.max_steps=100000 \
            --set train.keep_last=1000 $(cand_args "$c") $EXTRA >"$run.log" 2>&1 &
    done
done
wait
date -u +"recipes done %T" | tee -a "$LOG"
summarise
for c in $CANDS; do
    for s in $SEEDS; do
        run="$RUNS/$c-s$s"
        tail -n 12 "$run.log" | sed "s|^|$c-s$s: |" >>"$LOG"
        if [ -f "$run/results.json" ]; then
            OMP_NUM_THREADS=1 timeout -k 5 "$CURVE_LIMIT" $PY scripts/parse_curve.py "$run" \
                --device "$DEVICE" --every "$CURVE_EVERY" --json "$run/curve.json" \
                >"$run.curve.log" 2>&1 &
        fi
    done
done
wait
date -u +"curves done %T" | tee -a "$LOG"
summarise

tar czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude='*.pt' --exclude='*.sha256' --exclude=data \
    --exclude=tensorboard --exclude='*.trees' --exclude=tune --exclude=curve --exclude=evalb \
    --exclude='*.png' --exclude=trainer.lock . 2>>"$LOG"
ls -la "$OUT" | tee -a "$LOG"
date -u +"done %T" | tee -a "$LOG"
