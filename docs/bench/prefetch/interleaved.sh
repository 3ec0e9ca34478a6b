#!/bin/sh
# Interleaved rounds of the four configurations (sync / async embeddings, prefetch off / on), each run paired with
# its own one-process run (docs/bench/prefetch/run.py); one JSON line per run.  Usage: interleaved.sh ROUNDS STEPS
PY=${PY:-python}
for r in $(seq "${1:-3}"); do
  for cfg in "sync 0" "sync 1" "async 0" "async 1"; do
    $PY docs/bench/prefetch/run.py $cfg "${2:-150}" 2>/dev/null
  done
done
