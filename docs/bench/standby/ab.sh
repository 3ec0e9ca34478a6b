#!/bin/bash
# A/B of two checkouts (each with its extension built): DLRM 2x2 sync 40 steps without standbys, with --standbys 1, and
# with --kill-primary 0@13, interleaved; one JSON line a run, appended to OUT.
#   PY=$PWD/.venv/bin/python docs/bench/standby/ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT ROUNDS OUT
OLD=$1; NEW=$2; ROUNDS=${3:-2}; OUT=$4
for r in $(seq 1 $ROUNDS); do
  for tree in $OLD $NEW; do
    for v in 0 1 k; do
      sb=$v; extra=""; [ $v = k ] && sb=1 && extra="--kill-primary 0@13"
      d=$(mktemp -d /tmp/ab-XXXX)
      (cd $tree && PYTHONPATH=$tree timeout 900 ${PY:-python3} -c "from trainer.local.cluster import entrypoint; entrypoint()" --standbys $sb $extra --model dlrm --dataset criteo-synth --steps 40 --run-dir $d > /dev/null 2>&1)
      python3 -c "
import json,sys; d=json.load(open('$d/summary.json')); r=d.get('replication') or {}
print(json.dumps(dict(tree='$tree', round=$r, standbys='$v', failovers=d.get('failovers'), samples_per_sec=round(d['samples_per_sec'],1), steps_lost=d['steps_lost'], shipments=r.get('shipments'), capture_ms=round(1000*r['capture_seconds']/r['shipments'],1) if r.get('capture_seconds') else None, ship_ms=round(1000*r['ship_seconds']/r['shipments'],1) if r.get('ship_seconds') else None, load=open('/proc/loadavg').read().split()[0])))" | tee -a $OUT
      rm -rf $d
    done
  done
done
