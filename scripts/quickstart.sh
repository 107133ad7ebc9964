#!/usr/bin/env bash
# The main job, from a fresh machine: install aiayn, copy Multi30k (or download it), prepare
# a shared En-De subword vocabulary, train the `tiny` preset for a bounded time, average
# the last checkpoints, translate test_2016_flickr and print its BLEU.
#
#   bash scripts/quickstart.sh                      # 10 minutes of training
#   MINUTES=60 bash scripts/quickstart.sh           # a longer budget
#   bash scripts/quickstart.sh --max-steps 30       # extra flags go to `aiayn train`
#
# Environment: MINUTES (training budget, default 10), MULTI30K (local copy of the raw
# files, default ../shared/data/multi30k; downloaded from GitHub if absent), DATA (where
# the copied and prepared data go, default data), RUN (run directory, default
# runs/quickstart-tiny; an existing one is resumed), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MINUTES=${MINUTES:-10}
MULTI30K=${MULTI30K:-../shared/data/multi30k}
DATA=${DATA:-data}
RUN=${RUN:-runs/quickstart-tiny}
RAW=$DATA/multi30k
PREPARED=$DATA/multi30k-en-de

# constraints.txt pins torch to the CPU build; an unpinned torch pulls a multi-GB CUDA one.
"$PYTHON" -m pip install -q -c constraints.txt -e .

from=()
[[ -d "$MULTI30K" ]] && from=(--from "$MULTI30K")
aiayn data multi30k ${from[@]+"${from[@]}"} --out "$RAW" --splits train,val,test_2016_flickr \
    --langs en,de
aiayn prepare -s en -t de --trainpref "$RAW/train" --validpref "$RAW/val" \
    --testpref "$RAW/test_2016_flickr" --out "$PREPARED" --vocab-size 8000

# A checkpoint every tenth of the budget, so that there are several to average.
interval=$("$PYTHON" -c "print(max(float('$MINUTES') / 10, 0.1))")
aiayn train "$PREPARED" --out "$RUN" --preset tiny --max-minutes "$MINUTES" \
    --save-interval-minutes "$interval" "$@"

# The paper averages the last 5 checkpoints (section 6.1); a short run may have fewer.
n=$(find "$RUN" -maxdepth 1 -name 'checkpoint_[0-9]*.pt' | wc -l)
aiayn average "$RUN" --last "$(( n < 5 ? n : 5 ))" --out "$RUN/averaged.pt"
aiayn translate --checkpoint "$RUN/averaged.pt" --input "$RAW/test_2016_flickr.en.gz" \
    --output "$RUN/test_2016_flickr.de"
aiayn evaluate --hyp "$RUN/test_2016_flickr.de" --ref "$RAW/test_2016_flickr.de.gz"
