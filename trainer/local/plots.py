"""Loss and test accuracy against wall-clock time and step, for one run or several overlaid.

`ps-cluster` writes RUN_DIR/plot.png; `ps-plot RUN_DIR... -o comparison.png`
overlays runs (for example sync, async and stale-timeout with a straggler).
Every trainer's metrics file in a run folder is read (any ``*.jsonl`` that
starts a trainer's run, whatever its name): the lowest rank is drawn solid, the
others faint in the same colour, on one clock shared by the run's trainers.
"""

from __future__ import annotations

import json
from pathlib import Path

from psserver.common.cli_support import EnvArgumentParser, run_cli
from psserver.common.logsafe import counted


def read_trainer_file(path: Path) -> list[dict] | None:
    """The records of the last run a JSON-lines metrics file holds (files are appended to), or None if the file
    is not a trainer's metrics."""
    recs = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            return None
    starts = [i for i, r in enumerate(recs) if isinstance(r, dict) and r.get("event") == "start"]
    return recs[starts[-1]:] if starts else None


def find_trainers(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> records, for every trainer metrics file in ``run_dir``."""
    found = {}
    for path in sorted(Path(run_dir).glob("*.jsonl")):
        recs = read_trainer_file(path)
        if recs is not None:
            found.setdefault(int(recs[0].get("rank", len(found))), recs)
    if not found:
        raise ValueError(f"no trainer metrics (*.jsonl files that a trainer started) in {run_dir}: "
                         "is it a ps-cluster run folder?")
    return dict(sorted(found.items()))


def load_curves(run_dir: Path) -> dict:
    """The run's label and, per rank, loss and test accuracy against seconds since the first trainer started."""
    trainers = find_trainers(run_dir)
    t0 = min(recs[0]["time"] for recs in trainers.values())
    curves = {}
    for rank, recs in trainers.items():
        steps = [r for r in recs if r["event"] == "step"]
        evals = [r for r in recs if r["event"] == "eval"]
        curves[rank] = dict(
            loss_t=[r["time"] - t0 for r in steps], loss_step=[r["step"] for r in steps],
            loss=[r["loss"] for r in steps],
            acc_t=[r["time"] - t0 for r in evals], acc_step=[r["step"] for r in evals],
            acc=[r["test_accuracy"] for r in evals],
        )
    label = next(iter(trainers.values()))[0]["config"]["mode"]
    summary_path = Path(run_dir) / "summary.json"
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        if s.get("straggler_delay"):
            label += f" (straggler +{s['straggler_delay']:g}s/step)"
    return dict(label=f"{label}, {counted(len(trainers), 'trainer')}", ranks=curves)


def plot_runs(run_dirs: list[Path], output: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for i, run in enumerate(run_dirs):
        c = load_curves(run)
        colour = f"C{i % 10}"
        for j, (rank, r) in enumerate(c["ranks"].items()):
            style = dict(color=colour, label=c["label"] if j == 0 else None)
            if j:
                style.update(alpha=0.35, linewidth=0.8)
            axes[0, 0].plot(r["loss_t"], r["loss"], **style)
            axes[0, 1].plot(r["loss_step"], r["loss"], **style)
            axes[1, 0].plot(r["acc_t"], r["acc"], marker="o", **style)
            axes[1, 1].plot(r["acc_step"], r["acc"], marker="o", **style)
    for ax, (y, x) in zip(axes.flat, [("training loss", "wall time (s)"), ("training loss", "step"),
                                      ("test accuracy", "wall time (s)"), ("test accuracy", "step")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    fig.suptitle(title or "psgrpc: loss and test accuracy (lowest rank solid, the other trainers faint)")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    p = EnvArgumentParser(prog="ps-plot", description="Overlay loss and accuracy curves of ps-cluster runs.")
    p.add_argument("runs", nargs="+", help="run folders written by ps-cluster")
    p.add_argument("-o", "--output", default="comparison.png", help="PNG file to write")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    out = plot_runs([Path(r) for r in args.runs], Path(args.output), args.title)
    print(out)
    return 0


def entrypoint() -> None:
    run_cli("ps-plot", main)
