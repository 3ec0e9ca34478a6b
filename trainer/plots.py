"""Loss and test accuracy against wall-clock time and step, for one run or several overlaid.

`ps-cluster` writes RUN_DIR/plot.png; `ps-plot RUN_DIR... -o comparison.png`
overlays runs (for example sync, async and stale-timeout with a straggler).
Reads rank 0's metrics file, the trainer that evaluates most often.
"""

from __future__ import annotations

import json
from pathlib import Path

from psserver.cli_support import EnvArgumentParser, run_cli


def load_curves(run_dir: Path) -> dict:
    path = Path(run_dir) / "trainer0.jsonl"
    if not path.exists():
        raise ValueError(f"{path} does not exist: is {run_dir} a ps-cluster run folder?")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    start = next((r for r in recs if r["event"] == "start"), None)
    if start is None:
        raise ValueError(f"{path} has no start record")
    t0 = start["time"]
    steps = [r for r in recs if r["event"] == "step"]
    evals = [r for r in recs if r["event"] == "eval"]
    summary_path = Path(run_dir) / "summary.json"
    label = start["config"]["mode"]
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        if s.get("straggler_delay"):
            label += f" (straggler +{s['straggler_delay']:g}s/step)"
    return dict(
        label=label,
        loss_t=[r["time"] - t0 for r in steps], loss_step=[r["step"] for r in steps], loss=[r["loss"] for r in steps],
        acc_t=[r["time"] - t0 for r in evals], acc_step=[r["step"] for r in evals],
        acc=[r["test_accuracy"] for r in evals],
    )


def plot_runs(run_dirs: list[Path], output: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for run in run_dirs:
        c = load_curves(run)
        axes[0, 0].plot(c["loss_t"], c["loss"], label=c["label"])
        axes[0, 1].plot(c["loss_step"], c["loss"], label=c["label"])
        axes[1, 0].plot(c["acc_t"], c["acc"], marker="o", label=c["label"])
        axes[1, 1].plot(c["acc_step"], c["acc"], marker="o", label=c["label"])
    for ax, (y, x) in zip(axes.flat, [("training loss", "wall time (s)"), ("training loss", "step"),
                                      ("test accuracy", "wall time (s)"), ("test accuracy", "step")]):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    fig.suptitle(title or "psgrpc: rank 0's loss and test accuracy")
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
