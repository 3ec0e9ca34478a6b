#!/bin/sh
# Interleaved W=1 / W=4 runs of docs/bench/table-window/run.py, each with its own one-process run; one JSON line
# per run.  Usage: interleaved.sh ROUNDS STEPS
PY=${PY:-python}
for r in $(seq "${1:-3}"); do
  for w in 1 4; do
    $PY docs/bench/table-window/run.py $w "${2:-150}" 2>/dev/null
  done
done
