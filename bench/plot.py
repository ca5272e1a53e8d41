"""PNG charts from the JSON lines (or the CSV) the bench scripts print.

    python bench/compare_llamacpp.py ... > smollm135.jsonl
    python bench/plot.py smollm135.jsonl --out-dir docs/img --prefix smollm135-

Charts (each written only when the input has rows for it; one JSON line per chart written):

- ``throughput_vs_batch.png``: aggregate decode tok/s against sequences decoded together, one line
  per engine and weight class (``batched`` rows of compare_llamacpp.py; ``decode`` rows of
  ``infeng bench --json`` at several ``--batch``);
- ``roofline.png``: batch-1 decode tok/s against the weight bytes read per token, with the
  bandwidth roofline (measured bandwidth / bytes) as a line, one panel per thread count
  (``tg*`` rows of compare_llamacpp.py; ``decode`` rows of ``infeng bench --json`` with a roofline);
- ``ratios.png``: infeng / llama.cpp for prompt processing, decode and batched decode, per
  weight class and thread count (``ratio`` rows of compare_llamacpp.py), with the 1.0 line.

Needs matplotlib: ``pip install -e '.[bench]'``.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

MARKERS = {"infeng": "o", "llama.cpp": "s"}
COLORS = {"f16": "tab:blue", "bf16": "tab:cyan", "q8_0": "tab:orange", "q4_0": "tab:green", "f32": "tab:gray"}


def fail(message: str) -> None:
    print(f"plot.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text in ("True", "False"):
        return text == "True"
    return None if text == "" else text


def read_rows(paths: list[Path]) -> list[dict]:
    """Rows from JSON-lines files (other lines ignored) and CSV files (numbers parsed); '-' is stdin."""
    rows: list[dict] = []
    for path in paths:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        if path.suffix == ".csv":
            rows += [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(text.splitlines())]
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def label(row: dict) -> str:
    return row.get("weights") or row.get("dtype") or "?"


def batch_series(rows: list[dict]) -> dict[tuple, list[tuple[int, float]]]:
    """(engine, weights, threads) -> [(batch, tok/s)]."""
    series: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.get("bench") == "batched":
            key = (r["engine"], label(r), r.get("threads"))
        elif r.get("bench") == "decode" and "artifact" in r and "batch" in r and "engine" not in r:
            key = ("infeng", label(r), r.get("threads"))       # infeng bench --json
        else:
            continue
        b = int(r["batch"])
        series[key][b] = max(series[key].get(b, 0.0), float(r["tok_s"]))
    return {k: sorted(v.items()) for k, v in series.items() if len(v) > 1}


def roofline_points(rows: list[dict]) -> list[dict]:
    points = []
    for r in rows:
        bench = str(r.get("bench", ""))
        is_tg = bench.startswith("tg") and "engine" in r
        is_infeng_bench = bench == "decode" and r.get("batch", 1) == 1 and "artifact" in r and "engine" not in r
        if (is_tg or is_infeng_bench) and r.get("roofline_tok_s") and r.get("weights_mib"):
            points.append({"engine": r.get("engine", "infeng"), "weights": label(r), "threads": r.get("threads"),
                           "mib": float(r["weights_mib"]), "tok_s": float(r["tok_s"]),
                           "bandwidth_gb_s": float(r["bandwidth_gb_s"]), "roofline_tok_s": float(r["roofline_tok_s"])})
    return points


def plot_batches(plt, series: dict, out: Path, title: str) -> bool:
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (engine, weights, threads), pts in sorted(series.items(), key=lambda kv: tuple(map(str, kv[0]))):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=MARKERS.get(engine, "^"), color=COLORS.get(weights),
                linestyle="-" if engine == "infeng" else "--", label=f"{engine} {weights} ({threads} thr)")
        for x, y in pts:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("sequences decoded together")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(title or "batched decode throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return True


def plot_roofline(plt, points: list[dict], out: Path, title: str) -> bool:
    if not points:
        return False
    threads = sorted({p["threads"] for p in points}, key=str)
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), squeeze=False)
    for ax, t in zip(axes[0], threads):
        pts = [p for p in points if p["threads"] == t]
        lo, hi = min(p["mib"] for p in pts) / 1.6, max(p["mib"] for p in pts) * 1.6
        bw = max(p["bandwidth_gb_s"] for p in pts)
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax.plot(xs, [bw * 1e9 / (x * 2**20) for x in xs], color="black", linewidth=1,
                label=f"roofline: {bw:.1f} GB/s / weight bytes")
        for p in pts:
            ax.scatter(p["mib"], p["tok_s"], marker=MARKERS.get(p["engine"], "^"), color=COLORS.get(p["weights"]),
                       s=50, zorder=3, label=f"{p['engine']} {p['weights']}")
            ax.annotate(f"{p['tok_s']:.0f} ({100 * p['tok_s'] / p['roofline_tok_s']:.0f}%)", (p["mib"], p["tok_s"]),
                        textcoords="offset points", xytext=(6, -3), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("weight bytes read per token (MiB)")
        ax.set_ylabel("batch-1 decode tok/s")
        ax.set_title(f"{title + ', ' if title else ''}{t} thread{'s' if t != 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return True


def plot_ratios(plt, rows: list[dict], out: Path, title: str) -> bool:
    bars: list[tuple[str, str, float]] = []     # (group, test, ratio)
    for r in rows:
        if r.get("bench") != "ratio" or "weights" not in r:
            continue
        group = f"{r['weights']}\n{r.get('threads')} thr"
        if r.get("pp_ratio") is not None:
            bars.append((group, f"pp{r.get('pp_tokens', '')}", float(r["pp_ratio"])))
            bars.append((group, f"tg{r.get('tg_tokens', '')}", float(r["tg_ratio"])))
        elif r.get("decode") is not None and "batch" in r:
            bars.append((group, f"batch {r['batch']}", float(r["decode"])))
    if not bars:
        return False
    groups = list(dict.fromkeys(b[0] for b in bars))
    tests = list(dict.fromkeys(b[1] for b in bars))
    width = 0.8 / len(tests)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(tests) / 3)), 4.5))
    for i, test in enumerate(tests):
        xs, ys = [], []
        for g, grp in enumerate(groups):
            vals = [v for gg, tt, v in bars if gg == grp and tt == test]
            if vals:
                xs.append(g + (i - (len(tests) - 1) / 2) * width)
                ys.append(vals[-1])
        rects = ax.bar(xs, ys, width, label=test)
        ax.bar_label(rects, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("infeng / llama.cpp")
    ax.set_title(title or "infeng vs llama.cpp, same weights and threads")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="JSON-lines or .csv files ('-': stdin)")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--prefix", default="", help="file name prefix, e.g. 'smollm135-'")
    ap.add_argument("--title", default="", help="chart title prefix, e.g. the model name")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("matplotlib is not installed; pip install -e '.[bench]' (or pip install matplotlib)")
    for path in args.inputs:
        if str(path) != "-" and not path.is_file():
            fail(f"{path}: no such file")
    rows = read_rows(args.inputs)
    if not rows:
        fail("no JSON lines or CSV rows in the input")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    charts = {
        "throughput_vs_batch": lambda out: plot_batches(plt, batch_series(rows), out, args.title),
        "roofline": lambda out: plot_roofline(plt, roofline_points(rows), out, args.title),
        "ratios": lambda out: plot_ratios(plt, rows, out, args.title),
    }
    written = 0
    for name, draw in charts.items():
        out = args.out_dir / f"{args.prefix}{name}.png"
        if draw(out):
            written += 1
            print(json.dumps({"bench": "plot", "chart": name, "file": str(out)}), flush=True)
    if not written:
        fail("nothing to plot: no batched, tg/decode-with-roofline or ratio rows in the input")


if __name__ == "__main__":
    main()
