"""Tables of results.jsonl (written by rounds.py), as markdown on stdout.

    python3 docs/bench/cpp/summarize.py [docs/bench/cpp/results.jsonl]

Per configuration: each system's steps/s per worker in each round (median over rounds), total samples/s, the
1-minute load before each run, and the ratios psgrpc / Paddle and psgrpc / TF per round and their median.
psgrpc's figure is its better push window (W1 or W4) by median; both are listed.  Paddle's figure is the
pull-each-step variant (see README: Paddle 3.0's exe.run loop never refreshes the dense weights by itself).
"""
import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results.jsonl")
rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
by = defaultdict(dict)  # (workload, workers) -> {(system, variant): {round: row}}
for r in rows:
    by[(r["workload"], r["workers"])].setdefault((r["system"], r["variant"]), {})[r["round"]] = r


def med(xs):
    xs = [x for x in xs if x is not None]
    return st.median(xs) if xs else None


def f(x, d=1):
    return "—" if x is None else f"{x:.{d}f}"


for (workload, workers), systems in sorted(by.items()):
    rounds = sorted({rd for runs in systems.values() for rd in runs})
    print(f"\n### {workload}, 2 servers x {workers} worker{'s' if workers > 1 else ''} (async)\n")
    print("| system | " + " | ".join(f"round {rd}" for rd in rounds) + " | median steps/s per worker | median samples/s total |")
    print("|---|" + "---|" * (len(rounds) + 2))
    medians = {}
    for key in sorted(systems, key=lambda k: (k[0] != "psgrpc", k)):
        runs = systems[key]
        vals = [runs[rd].get("steps_per_s") if rd in runs else None for rd in rounds]
        tot = [runs[rd].get("samples_per_s") if rd in runs else None for rd in rounds]
        medians[key] = med(vals)
        name = f"{key[0]} {key[1]}".strip()
        cells = [f(v) if v is not None else ("failed" if rd in runs else "—") for v, rd in zip(vals, rounds)]
        print(f"| {name} | " + " | ".join(cells) + f" | {f(med(vals))} | {f(med(tot), 0)} |")
    loads = [runs[rd]["load_before"][0] for runs in systems.values() for rd in runs]
    print(f"\n1-minute load before the runs: median {f(med(loads), 2)}, range {f(min(loads), 2)}-{f(max(loads), 2)}")
    ps_variants = {k: v for k, v in medians.items() if k[0] == "psgrpc" and k[1] in ("W1", "W4") and v}
    if not ps_variants:
        continue
    best = max(ps_variants, key=ps_variants.get)
    print(f"\npsgrpc's figure: push window {best[1][1:]} (the better median)\n")
    print("| ratio | " + " | ".join(f"round {rd}" for rd in rounds) + " | median of the per-round ratios |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for other in (("paddle", "pull-each-step"), ("tf", ""), ("paddle", "as-is (no dense pull)")):
        if other not in systems:
            continue
        ratios = []
        for rd in rounds:
            a, b = systems[best].get(rd, {}).get("steps_per_s"), systems[other].get(rd, {}).get("steps_per_s")
            ratios.append(a / b if a and b else None)
        name = f"psgrpc / {other[0]} {other[1]}".strip()
        print(f"| {name} | " + " | ".join(f(x, 2) for x in ratios) + f" | **{f(med(ratios), 2)}** |")

# the one-process reference: each 2x1 click system's steps/s over the one-process rate of the same round
ref = by.get(("click", 1), {}).get(("psgrpc", "one process"))
if ref:
    systems = by[("click", 1)]
    rounds = sorted(ref)
    print("\n### click, against one process (`nn.EmbeddingBag(sparse=True)` + torch sparse Adagrad), same round\n")
    print("| system (2 servers x 1 worker) | " + " | ".join(f"round {rd}" for rd in rounds) + " | median |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for key in sorted(systems, key=lambda k: (k[0] != "psgrpc", k)):
        if key == ("psgrpc", "one process"):
            continue
        rs = [systems[key][rd]["steps_per_s"] / ref[rd]["steps_per_s"]
              if rd in systems[key] and systems[key][rd].get("steps_per_s") else None for rd in rounds]
        print(f"| {key[0]} {key[1]} | " + " | ".join(f(x, 2) for x in rs) + f" | {f(med(rs), 2)} |")
