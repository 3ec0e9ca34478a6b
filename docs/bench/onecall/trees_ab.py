"""Two (or more) versions of the trainer, A/B inside one run (issue 21, trainerlean): each block is one run of
docs/bench/onecall/cpu.py (the click model, 2 local shards, 1 trainer, prefetch, STEPS steps) with the library
imported from one source tree, the trees taking turns, the order rotated every round, so a shared machine's drift
falls on every way alike.  A way is NAME=TREE[:PUSH_WINDOW] (a tree: a checkout or ``git archive`` of a commit).
One JSON line a block (cpu.py's: trainer and shards CPU ms a step, wall ms a step), then medians and, against the
first way, the median of the paired differences (block k of a way against the first way's block of its round).

    python docs/bench/onecall/trees_ab.py MODE ROUNDS STEPS NAME=TREE[:W] NAME=TREE[:W] ...
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CPU = Path(__file__).with_name("cpu.py")


def block(mode: str, steps: int, tree: str, window: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, str(CPU), mode, "1", str(steps), window], env=env, cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(mode: str, rounds: int, steps: int, ways: dict[str, tuple[str, str]]) -> None:
    names = list(ways)
    out: dict[str, list] = {w: [] for w in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(k + r) % len(names)]
            line = {"way": name, "round": r, **block(mode, steps, *ways[name])}
            line["steps_per_s"] = round(1000 / line["wall_ms"], 2)
            out[name].append(line)
            print(json.dumps(line), flush=True)
    keys = ("trainer_ms", "wall_ms", "steps_per_s")
    medians = {w: {m: round(statistics.median(x[m] for x in v), 3) for m in keys}
               | {"shards_ms": round(statistics.median(sum(x["shards_ms"]) for x in v), 3)} for w, v in out.items()}
    first = names[0]
    paired = {w: {m: round(statistics.median(b[m] - a[m] for a, b in zip(out[first], out[w])), 3) for m in keys}
              for w in names[1:]}
    print(json.dumps({"mode": mode, "steps": steps, "rounds": rounds, "medians": medians,
                      f"paired_minus_{first}": paired}))


if __name__ == "__main__":
    spec = {}
    for arg in sys.argv[4:]:
        name, rest = arg.split("=", 1)
        tree, _, window = rest.partition(":")
        spec[name] = (tree, window or "1")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), spec)
