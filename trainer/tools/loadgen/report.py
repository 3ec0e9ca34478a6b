"""The Markdown table and the plot of a run."""

from __future__ import annotations

from pathlib import Path

from psserver.common.logsafe import counted


def _cell(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def _health_cell(h: dict | None) -> str:
    """p50 / p99 / max ms of a health stats dict, or "-" when that port was not probed."""
    if h is None:
        return "-"
    return f"{_cell(h['p50_ms'])} / {_cell(h['p99_ms'])} / {_cell(h['max_ms'])}"


def _health_fails(h: dict, port: dict | None) -> str:
    """Failed probes by code: the main port's, then the health port's (marked "port:")."""
    parts = [_codes(h["failures"])] if h["failures"] else []
    if port and port["failures"]:
        parts.append(f"port: {_codes(port['failures'])}")
    return "; ".join(parts) or "-"


def markdown(result: dict) -> str:
    server = " ".join(result["server_args"]) or "default flags"
    if result.get("health_port"):
        server += f", health port: {result['health_port']}"
    lines = [f"ps-loadgen: mode {result['mode']}, P = {result['params']}, window {result['window']}, "
             f"client procs {result['client_procs']}, shard {result['shard']} ({server}), {result['machine']}", ""]
    if result["rows"]:
        lines += ["| N | status | rounds | pushes/s | rounds/s | step p50 / p99 ms | health p50 / p99 / max ms "
                  "| health port p50 / p99 / max ms | health fails | shard CPU s/s | shard RSS MB "
                  "| RSS KB / extra trainer | client CPU s/s | errors |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for r in result["rows"]:
            s, h, st = r["shard"], r["health"], r["step"]
            odd = {k: v for k, v in r["outcomes"].items() if k not in ("applied", "accepted")}
            rounds = f"{r['rounds']}" + (f" ({_codes(odd)})" if odd else "")
            lines.append(
                f"| {r['trainers']} | {r['status']} | {rounds} | {_cell(r['pushes_per_s'])} "
                f"| {_cell(r['rounds_per_s'], '{:.2f}')} "
                f"| {_cell(st['p50_ms'])} / {_cell(st['p99_ms'])} | {_health_cell(h)} "
                f"| {_health_cell(r.get('health_port'))} | {_health_fails(h, r.get('health_port'))} "
                f"| {_cell(s['cpu_per_s'], '{:.2f}')} "
                f"| {_cell(s['rss_end_mb'])} | {_cell(s.get('rss_growth_kb_per_trainer'))} "
                f"| {_cell(r['client']['cpu_per_s'], '{:.2f}')} | {_codes(r['errors'])} |")
        lines += ["", "rounds and pushes/s: the measured window after warm-up (sync: exactly the rounds it spans); "
                      "step: one PushPull, round wait included; "
                      "health: Health.Check on the main port -- the standard service on the shard's own port, "
                      "answered by its event loop, so it queues behind the shard's calls; "
                      "health port: Health.Check on ps-server --health-port -- a process of its own, not queued "
                      "behind the loop, that still reads NOT_SERVING if the loop stalls (\"-\": not probed; "
                      "see --health-port, or --health-address with --ps); both probed every "
                      f"{result['config']['health_interval'] * 1000:g} ms over the whole run, setup included; "
                      "health fails: failed probes by code (\"port:\" for the health port's); "
                      "errors: failed calls by status code, each retried."]
    stall = result.get("stall")
    if stall:
        lines += ["", f"Stall: a stranger holds {counted(stall['streams'], 'silent Push stream')} open "
                      f"({counted(stall['connections'], 'connection')}) beside a sync job of "
                      f"{counted(stall['trainers'], 'trainer')} "
                      f"-- {stall['status']}", "",
                  "| phase | rounds | of them without everyone | steps | step p50 / p99 ms | health p50 / p99 / max ms "
                  "| health port p50 / p99 / max ms | health fails | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for p in stall["phases"]:
            h, hp = p["health"], p.get("health_port")
            lines.append(f"| {p['phase']} | {p['rounds']} | {p['partial_rounds']} | {p['steps']} "
                         f"| {_cell(p['step']['p50_ms'])} / {_cell(p['step']['p99_ms'])} | {_health_cell(h)} "
                         f"| {_health_cell(hp)} | {_health_fails(h, hp)} | {_codes(p['errors'])} |")
        r, s = stall["step_ratio"], stall.get("stranger") or {}
        ratio = (f"p50 {r['p50_ms']:.2f}x, p99 {r['p99_ms']:.2f}x" if r.get("p50_ms") is not None
                 and r.get("p99_ms") is not None else "no step completed while stalled")
        stalled = next((p for p in stall["phases"] if p["phase"] == "stalled"), None)
        if stalled and stalled["partial_rounds"]:
            ratio += " (but rounds closed without every trainer, so these are not like steps)"
        expired = (stall["shard_stats"].get("counters") or {}).get("lease_expired")
        dropped = f"; trainers dropped by the shard for silence (lease expired): {expired:g}" if expired else ""
        lines += ["", f"step time stalled / unloaded: {ratio}; stranger streams still open at release: "
                      f"{s.get('open_at_release', '-')}, ended before release: "
                      f"{_codes(s.get('ended_before_release', {}))}{dropped}"]
    examples = {k: v for r in result["rows"] for k, v in r["error_examples"].items()}
    if stall:
        examples.update(stall["error_examples"])
    if examples:
        lines += ["", "First message per status code:"] + [f"* {k}: {v}" for k, v in sorted(examples.items())]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), constrained_layout=True)
    ns = [r["trainers"] for r in rows]

    def series(ax, values, label, marker="o"):
        pts = [(n, v) for n, v in zip(ns, values) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)

    series(axes[0], [r["pushes_per_s"] for r in rows], "pushes/s")
    series(axes[0], [r["rounds_per_s"] for r in rows], "rounds/s", "s")
    axes[0].set_title("throughput")
    series(axes[1], [r["health"]["p99_ms"] for r in rows], "health p99 (main port)")
    series(axes[1], [r["health"]["max_ms"] for r in rows], "health max (main port)", "^")
    series(axes[1], [(r.get("health_port") or {}).get("p99_ms") for r in rows], "health port p99", "D")
    failed = [(n, h["p99_ms"]) for n, r in zip(ns, rows) for h in (r["health"], r.get("health_port"))
              if h and h["failures"] and h["p99_ms"]]
    if failed:
        axes[1].plot(*zip(*failed), "rx", markersize=12, label="probes failed")
    axes[1].axhline(50, color="grey", linestyle="--", linewidth=1, label="50 ms")
    axes[1].set_title("health-check latency (ms)")
    series(axes[2], [r["step"]["p50_ms"] for r in rows], "step p50")
    series(axes[2], [r["step"]["p99_ms"] for r in rows], "step p99", "s")
    axes[2].set_title("step (PushPull) latency (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("simulated trainers N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
