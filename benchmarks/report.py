"""Turn one benchmark run into ratios, target verdicts, JSON, Markdown and a PNG chart.

The targets are issue 4's, as ratios measured in the same run. A target that is
missed is reported (MISS), never raised: figures do not fail the benchmark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WARM, COLD, NAIVE, JUPYTER, SESSION = (
    "appliance_warm",
    "appliance_cold",
    "naive_firejail",
    "jupyter_kernel",
    "appliance_session",
)
LABELS = {
    WARM: "appliance, warm pool",
    COLD: "appliance, pool off (cold jail)",
    NAIVE: "naive firejail spawn",
    JUPYTER: "warm Jupyter kernel (Kernel Gateway)",
    SESSION: "appliance session (same jail)",
}
SCENARIOS = {
    "print": "`print(2+2)` round trip",
    "pandas": "pandas groupby, 100k rows",
    "matplotlib": "matplotlib figure to PNG",
    "session": "stateful session cell",
}
PSS_LIMIT_MB = 150.0


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    goal: str
    met: bool | None  # None: could not be judged (a figure is missing)

    def verdict(self) -> str:
        return "n/a" if self.met is None else "PASS" if self.met else "MISS"


def _p50(results: dict[str, Any], scenario: str, target: str) -> float | None:
    entry = results.get("latency", {}).get(scenario, {}).get(target)
    return float(entry["p50_ms"]) if entry else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def targets(results: dict[str, Any]) -> list[Target]:
    """Issue 4's and issue 18's targets judged against this run's figures."""
    warm = _p50(results, "print", WARM)
    naive_x = _ratio(_p50(results, "print", NAIVE), warm)
    jupyter_x = _ratio(_p50(results, "print", JUPYTER), warm)
    pandas_x = _ratio(_p50(results, "pandas", NAIVE), _p50(results, "pandas", WARM))
    tp = results.get("throughput", {})
    capacity = tp.get("spawn_capacity", {}).get("spawns_per_s")
    peak = max((lvl["runs_per_s"] for lvl in tp.get("levels", [])), default=None)
    tp_share = _ratio(peak, capacity)
    pss = results.get("memory", {}).get("pss_mb_per_warm_jail")
    eval_ratio = results.get("eval", {}).get("ratio")

    def judge(value: float | None, ok: bool) -> bool | None:
        return None if value is None else ok

    return [
        Target(
            "print(2+2) p50, warm pool (ms)", warm, "<= 2 ms", judge(warm, warm is not None and warm <= 2.0)
        ),
        Target(
            "print(2+2): naive firejail p50 / warm p50",
            naive_x,
            ">= 20x",
            judge(naive_x, naive_x is not None and naive_x >= 20),
        ),
        Target(
            "print(2+2): warm Jupyter p50 / warm p50",
            jupyter_x,
            "> 1x (faster than Jupyter)",
            judge(jupyter_x, jupyter_x is not None and jupyter_x > 1),
        ),
        Target(
            "pandas cell: naive firejail p50 / warm p50",
            pandas_x,
            ">= 50x",
            judge(pandas_x, pandas_x is not None and pandas_x >= 50),
        ),
        Target(
            "peak sustained runs/s / jail-spawn capacity",
            tp_share,
            ">= 0.90",
            judge(tp_share, tp_share is not None and tp_share >= 0.9),
        ),
        Target(
            "idle PSS per warm jail (MB)",
            pss,
            f"< {PSS_LIMIT_MB:.0f} MB",
            judge(pss, pss is not None and pss < PSS_LIMIT_MB),
        ),
        Target(
            "import-light eval runs/s: default / SANDBOX_PRELOAD=''",
            eval_ratio,
            ">= 0.8",
            judge(eval_ratio, eval_ratio is not None and eval_ratio >= 0.8),
        ),
    ]


def ratio_lines(results: dict[str, Any]) -> list[str]:
    """For each scenario: how many times faster the warm appliance is than each baseline (p50, p99)."""
    lines = []
    for scenario, by_target in results.get("latency", {}).items():
        base = by_target.get(WARM) or by_target.get(SESSION)
        if not base:
            continue
        ref = WARM if WARM in by_target else SESSION
        for name, entry in by_target.items():
            if name == ref:
                continue
            lines.append(
                f"{scenario:<10} {LABELS.get(name, name):<40} p50 {entry['p50_ms'] / base['p50_ms']:8.1f}x"
                f"   p99 {entry['p99_ms'] / base['p99_ms']:8.1f}x   slower than {LABELS[ref]}"
            )
    return lines


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    """The Markdown report: latency tables, throughput, memory, targets."""
    meta = results["meta"]
    out = [
        f"# Appliance benchmark{' (quick)' if meta.get('quick') else ''}",
        "",
        f"{meta['when']} · {meta['machine']} · {meta['cpus']} CPUs · load average before "
        f"{meta['loadavg_before']}, after {meta['loadavg_after']} · {meta['seconds']:.0f} s · "
        f"commit {meta.get('commit', '?')}",
        "",
        "All figures are round trips measured by a WebSocket client on loopback, in milliseconds, "
        "over the runs counted in `n`. Latency samples are taken one at a time, each only once the "
        "warm pool is full and idle and 100 ms after the last request, targets interleaved round by round.",
        "",
    ]
    for scenario, by_target in results["latency"].items():
        out += [
            f"## {SCENARIOS.get(scenario, scenario)}",
            "",
            "| target | n | p50 | p90 | p99 | min | max |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, s in by_target.items():
            out.append(
                f"| {LABELS.get(name, name)} | {s['n']} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | "
                f"{s['p99_ms']:.2f} | {s['min_ms']:.2f} | {s['max_ms']:.2f} |"
            )
        out.append("")
    tp = results["throughput"]
    cap = tp["spawn_capacity"]
    out += [
        "## Throughput: one-shot `print(2+2)`, each run in a fresh jail",
        "",
        f"Jail-spawn capacity of this machine (`JailFactory.launch()` + `destroy()` of a bare "
        f"jail, the profile a `print(2+2)` run gets, {cap['parallel']} at a time, {cap['spawns']} spawns in {cap['seconds']:.1f} s): "
        f"**{cap['spawns_per_s']:.2f} spawns/s** (launch p50 {cap['launch_p50_ms']:.0f} ms).",
        "",
        "| clients | runs/s | share of spawn capacity | runs | cold starts | p50 | p90 | p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lvl in tp["levels"]:
        share = lvl["runs_per_s"] / cap["spawns_per_s"] if cap["spawns_per_s"] else 0.0
        out.append(
            f"| {lvl['clients']} | {lvl['runs_per_s']:.2f} | {share:.0%} | {lvl['runs']} | "
            f"{lvl['cold_starts']} | {lvl['p50_ms']:.1f} | {lvl['p90_ms']:.1f} | {lvl['p99_ms']:.1f} |"
        )
    mem = results["memory"]
    out += [
        "",
        "## Idle memory per warm jail (default preload: numpy, pandas, matplotlib)",
        "",
        f"PSS per warm jail: **{fmt(mem['pss_mb_per_warm_jail'], 1)} MB** "
        f"(`appliance_jail_pss_bytes`: {fmt(mem['pss_mb_metric'], 1)} MB; /proc smaps_rollup of the idle "
        f"pool's jails: {', '.join(fmt(v, 1) for v in mem['pss_mb_proc'])} MB).",
        "",
    ]
    ev = results.get("eval")
    if ev:
        out += [
            "## Import-light eval load (issue 18)",
            "",
            f"{ev['default']['programs']} generated stdlib-only programs with asserts, "
            f"{ev['default']['clients']} clients, one-shot runs back to back. At default settings a run goes "
            "to the preload profile its imports fit (stdlib code: a bare jail).",
            "",
            "| server | runs/s | p50 ms | p90 ms |",
            "|---|---:|---:|---:|",
        ]
        for name, label in (("default", "default settings (profiles)"), ("no_preload", "SANDBOX_PRELOAD=''")):
            r = ev[name]
            out.append(f"| {label} | {r['runs_per_s']:.2f} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} |")
        out += ["", f"Ratio default / no preload: **{ev['ratio']:.2f}** (target >= 0.8).", ""]
    flags = results.get("flags")
    if flags:
        out += [
            "## What each firejail flag costs per jail (`python -I -c pass`, p50)",
            "",
            "| variant | wall ms | CPU ms |",
            "|---|---:|---:|",
        ]
        out += [f"| {name} | {c['wall_ms']:.1f} | {c['cpu_ms']:.1f} |" for name, c in flags.items()]
        out.append("")
    nd = results.get("jupyter_nodelay", {})
    if nd:
        nagle = nd.get("print_p50_ms_with_nagle")
        out += [
            f"Jupyter baseline: TCP_NODELAY read back from the live sockets: client {nd['client']}, "
            f"gateway {nd['server']}"
            + (f"; with Nagle left on, the same `print(2+2)` p50 is {nagle:.1f} ms." if nagle else "."),
            "",
        ]
    out += [
        "## Targets (issues 4 and 18)",
        "",
        "| target | goal | this run | verdict |",
        "|---|---|---:|---|",
    ]
    for t in targets(results):
        out.append(f"| {t.name} | {t.goal} | {fmt(t.value)} | {t.verdict()} |")
    out.append("")
    return "\n".join(out)


def chart(results: dict[str, Any], path: Path) -> None:
    """Latency bars (log scale, p50 with p90/p99 marks) and throughput against clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latency = results["latency"]
    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(14, 5.5))
    names = [WARM, SESSION, COLD, NAIVE, JUPYTER]
    colors = {
        WARM: "tab:green",
        SESSION: "tab:olive",
        COLD: "tab:orange",
        NAIVE: "tab:red",
        JUPYTER: "tab:blue",
    }
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, p50, p90, p99 = [], [], [], []
        for j, scenario in enumerate(latency):
            s = latency[scenario].get(name)
            if s:
                xs.append(j + (i - len(names) / 2 + 0.5) * width)
                p50.append(s["p50_ms"])
                p90.append(s["p90_ms"])
                p99.append(s["p99_ms"])
        if xs:
            ax_lat.bar(xs, p50, width, label=LABELS[name], color=colors[name])
            ax_lat.scatter(xs, p90, marker="_", color="black", s=60, zorder=3)
            ax_lat.scatter(xs, p99, marker="x", color="black", s=20, zorder=3)
    ax_lat.set_yscale("log")
    ax_lat.set_xticks(
        range(len(latency)), [SCENARIOS.get(s, s).replace("`", "") for s in latency], fontsize=8
    )
    ax_lat.set_ylabel("round trip, ms (bar p50, – p90, x p99; log)")  # noqa: RUF001 (the p90 tick is drawn as a dash)
    ax_lat.set_title("Latency")
    ax_lat.legend(fontsize=7)
    tp = results["throughput"]
    clients = [lvl["clients"] for lvl in tp["levels"]]
    ax_tp.plot(
        clients, [lvl["runs_per_s"] for lvl in tp["levels"]], "o-", color="tab:green", label="one-shot runs/s"
    )
    ax_tp.axhline(
        tp["spawn_capacity"]["spawns_per_s"], color="tab:red", linestyle="--", label="jail-spawn capacity"
    )
    ax_tp.set_xscale("log", base=2)
    ax_tp.set_xticks(clients, [str(c) for c in clients])
    ax_tp.set_xlabel("concurrent clients")
    ax_tp.set_ylabel("runs/s")
    ax_tp.set_ylim(bottom=0)
    ax_tp.set_title("Throughput (each run in a fresh jail)")
    twin = ax_tp.twinx()
    twin.plot(clients, [lvl["p50_ms"] for lvl in tp["levels"]], "s:", color="tab:gray", label="p50 ms")
    twin.plot(clients, [lvl["p99_ms"] for lvl in tp["levels"]], "^:", color="black", label="p99 ms")
    twin.set_yscale("log")
    twin.set_ylabel("latency, ms (log)")
    lines = ax_tp.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax_tp.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Write <stem>.json, <stem>.md and <stem>.png under out_dir; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        **results,
        "targets": [
            {"name": t.name, "value": t.value, "goal": t.goal, "verdict": t.verdict()}
            for t in targets(results)
        ],
    }
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(markdown(results))
    chart(results, paths[2])
    return paths
