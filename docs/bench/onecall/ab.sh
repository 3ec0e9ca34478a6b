#!/bin/sh
# Two checkouts A and B (e.g. `git archive REV | tar -x -C DIR`) in alternating order (A B, then B A, ...), each run
# docs/bench/onecall/run.py MODE 1 STEPS (one Step a shard, prefetch on) paired with its own one-process run; one JSON
# line per run with its tree and round.  Usage: ab.sh A B ROUNDS STEPS MODE...
A=$1; B=$2; R=$3; S=$4; shift 4
PY=${PY:-python}
for r in $(seq "$R"); do
  if [ $((r % 2)) = 1 ]; then trees="$A $B"; else trees="$B $A"; fi
  for m in "$@"; do for t in $trees; do
    echo "{\"tree\": \"$t\", \"round\": $r, \"run\": $(cd "$t" && PYTHONPATH=$t $PY docs/bench/onecall/run.py "$m" 1 "$S" 2>/dev/null)}"
  done; done
done
