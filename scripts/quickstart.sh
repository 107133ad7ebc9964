#!/usr/bin/env bash
# The main job, from a fresh machine: install aiayn, then run the Multi30k En->De recipe
# (configs/multi30k-en-de.toml) for a bounded training time: copy (or download) the data,
# learn the shared subword vocabulary, train, average the last checkpoints, translate
# test_2016_flickr with beam search and print every BLEU convention side by side.
#
#   bash scripts/quickstart.sh                      # 10 minutes of training
#   MINUTES=60 bash scripts/quickstart.sh           # the full recipe (docs/results.md)
#   bash scripts/quickstart.sh --set max_steps=30   # extra flags go to `aiayn recipe`
#
# Environment: MINUTES (training budget, default 10), MULTI30K (local copy of the raw
# files, default ../shared/data/multi30k; downloaded from GitHub if absent), RUN (run
# directory, default runs/quickstart; an existing one is resumed), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MINUTES=${MINUTES:-10}
MULTI30K=${MULTI30K:-../shared/data/multi30k}
RUN=${RUN:-runs/quickstart}

# constraints.txt pins torch to the CPU build; an unpinned torch pulls a multi-GB CUDA one.
"$PYTHON" -m pip install -q -c constraints.txt -e '.[plot]'

data=()
[[ -d "$MULTI30K" ]] && data=(--data "$MULTI30K")
aiayn recipe configs/multi30k-en-de.toml ${data[@]+"${data[@]}"} --out "$RUN" \
    --max-minutes "$MINUTES" "$@"
