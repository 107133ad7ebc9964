#!/usr/bin/env bash
# Interleaved before/after benchmark of two source trees (e.g. a worktree of the previous
# commit and this one), the order alternating by round so that running second is no bias:
#   git worktree add /tmp/before HEAD~1
#   bash benchmarks/before_after.sh /tmp/before/src src 3 > ab.jsonl
# One JSON line per measurement: {"round", "side", "row", "result": aiayn bench's JSON}.
# ROWS (one `aiayn bench` argument string a line) overrides the CPU rows of
# docs/performance.md.
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); rounds=${3:-3}
default_rows="train --preset tiny --dtype fp32
train --preset tiny --dtype bf16
train --preset base --dtype fp32 --steps 4
train --preset base --dtype bf16 --steps 4
decode --preset tiny --dtype fp32 --beam 4 --workers 2
decode --preset tiny --dtype bf16 --beam 4 --workers 2
decode --preset tiny --dtype int8 --beam 4 --workers 2
decode --preset base --dtype fp32 --beam 4 --workers 2 --sentences 128
decode --preset base --dtype bf16 --beam 4 --workers 2 --sentences 128
decode --preset base --dtype int8 --beam 4 --workers 2 --sentences 128
decode --preset base --dtype bf16 --beam 1 --workers 2 --sentences 128
decode --preset base --dtype int8 --beam 1 --workers 2 --sentences 128"
mapfile -t rows <<< "${ROWS:-$default_rows}"
for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then order="before after"; else order="after before"; fi
  for row in "${rows[@]}"; do
    for side in $order; do
      if [[ $side == before ]]; then src=$before; else src=$after; fi
      # shellcheck disable=SC2086  # the row is several arguments
      r=$(cd /tmp && PYTHONPATH=$src timeout 900 python3 -m aiayn bench $row --json 2>/dev/null \
          | tail -1)
      echo "{\"round\": $round, \"side\": \"$side\", \"row\": \"$row\", \"result\": ${r:-null}}"
    done
  done
done
