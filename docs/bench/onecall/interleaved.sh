#!/bin/sh
# Interleaved rounds of sync / async embeddings x one call off / on (prefetch on in all), each run paired with its
# own one-process run (docs/bench/onecall/run.py); one JSON line per run.  Usage: interleaved.sh ROUNDS STEPS
PY=${PY:-python}
for r in $(seq "${1:-3}"); do
  for cfg in "sync 0" "sync 1" "async 0" "async 1"; do
    $PY docs/bench/onecall/run.py $cfg "${2:-150}" 2>/dev/null
  done
done
