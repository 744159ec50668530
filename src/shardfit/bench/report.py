"""Bench output, all from the one report dict: terminal table, JSON, CSV, PNG charts, HTML.

Every number the table and the HTML show goes through `fmt`, and every HTML cell carries the JSON
path it came from (`data-path`), so a test can check the rendered page against report.json."""
from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path

from shardfit.estimate.result import CATEGORIES
from shardfit.measure.oom import Diagnosis, format_diagnosis

# (header, JSON path inside one result, format)
COLUMNS = (
    ("strategy", "strategy", "text"),
    ("status", "status", "text"),
    ("peak measured", "memory.peak_bytes", "bytes"),
    ("peak predicted", "predicted.peak_bytes", "bytes"),
    ("pred. error", "memory_error.rel_error", "pct"),
    ("step median", "step_time_s.median", "ms"),
    ("step IQR", "step_time_s.iqr", "ms"),
    ("tokens/s", "tokens_per_s", "int"),
    ("comm/step", "comm.bytes", "bytes"),
    ("comm volume", "comm.volume_bytes", "bytes"),
    ("theory volume", "comm_theory.volume_bytes", "bytes"),
    ("loss@K", "loss.final", "loss"),
    ("vs reference", "correctness.rel_diff", "pct"),
    ("correct", "correctness.status", "text"),
    ("ckpt loaded exactly", "checkpoint.exact_at_load", "bool"),
    ("resume exact", "checkpoint.exact", "bool"),
    ("save", "checkpoint.save_s", "s"),
    ("load", "checkpoint.load_s", "s"),
    ("ckpt size", "checkpoint.bytes", "bytes"),
)


def get(data, path: str):
    for key in path.split("."):
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        else:
            return None
    return data


def fmt(value, kind: str) -> str:
    """The one formatter of shown numbers (decimal MB, as the JSON's bytes / 1e6)."""
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / 1e6:.3f} MB"
    if kind == "pct":
        return f"{value * 100:+.2f}%"
    if kind == "ms":
        return f"{value * 1e3:.2f} ms"
    if kind == "s":
        return f"{value:.3f} s"
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "loss":
        return f"{value:.5f}"
    if kind == "bool":
        return "yes" if value else "NO"
    return str(value)


def table(report: dict) -> str:
    rows = [[header for header, _, _ in COLUMNS]]
    for result in report["results"]:
        rows.append([fmt(get(result, path), kind) for _, path, kind in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    remarks = notes(report)
    return "\n".join(lines + ([""] + remarks if remarks else []))


def notes(report: dict) -> list[str]:
    """One line per strategy that failed, ran out of memory, or diverged (with the likely cause)."""
    out = []
    for result in report["results"]:
        if result.get("status") != "ok":
            out.append(f"{result['strategy']}: {result['status']}: {result.get('error', '')}")
            if result.get("diagnosis"):
                out += ["  " + line for line in format_diagnosis(Diagnosis.from_dict(result["diagnosis"])).splitlines()]
        elif get(result, "correctness.status") == "diverged":
            out.append(f"{result['strategy']}: loss diverged from the reference: likely "
                       f"{result['correctness']['likely_cause']}")
        elif get(result, "checkpoint.exact") is False and get(result, "checkpoint.exact_at_load"):
            out.append(f"{result['strategy']}: checkpoint loaded bit-identically, but the resumed step differs "
                       f"by up to {get(result, 'checkpoint.resumed_step_max_abs_diff'):.1e} (not bit-reproducible)")
        elif get(result, "checkpoint.exact") is False:
            out.append(f"{result['strategy']}: checkpoint NOT restored exactly: "
                       f"{get(result, 'checkpoint.restored') or get(result, 'checkpoint.error')}")
    return out


def _flatten(data, prefix: str, out: dict) -> dict:
    if isinstance(data, dict):
        for key, value in data.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(data, (list, tuple)) and data and all(not isinstance(v, (dict, list)) for v in data):
        out[prefix] = ";".join(str(v) for v in data)
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            _flatten(value, f"{prefix}.{index}", out)
    else:
        out[prefix] = data
    return out


def write_csv(report: dict, path: Path) -> None:
    rows = []
    for result in report["results"]:
        row = _flatten(result, "", {})
        _flatten(report["environment"], "env", row)
        _flatten(report["settings"], "settings", row)
        _flatten(report["plan"], "plan", row)
        rows.append(row)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# chart id (its file name) -> the title a reader sees under it
CHART_TITLES = {"memory": "Memory per rank at the peak phase, by category: measured vs predicted",
                "step_time": "Step time per strategy (median, min–max)",
                "comm": "Collective traffic per step and rank, by kind, vs the ideal"}


def charts(report: dict, folder: Path) -> dict[str, Path]:
    """memory.png (by category, measured vs predicted), step_time.png, comm.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    ok = [r for r in report["results"] if r.get("status") == "ok"]
    labels = [r["strategy"] for r in ok]
    paths = {}
    colors = dict(zip(CATEGORIES, ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")))

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ok) + 2), 4.2))
    width = 0.38
    for offset, source in ((-width / 2, "measured"), (width / 2, "predicted")):
        bottoms = [0.0] * len(ok)
        for category in CATEGORIES:
            values = []
            for r in ok:
                cats = (r["memory"]["by_category_at_peak"] if source == "measured"
                        else get(r, "predicted.by_category_at_peak") or {})
                values.append(cats.get(category, 0) / 1e6)
            xs = [i + offset for i in range(len(ok))]
            ax.bar(xs, values, width, bottom=bottoms, color=colors[category], edgecolor="white",
                   hatch="" if source == "measured" else "//", label=category if source == "measured" else None)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right")
    ax.set_ylabel("MB per rank at the peak phase")
    ax.set_title("Memory by category: measured (left, plain) vs predicted (right, hatched)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["memory"] = folder / "memory.png"
    fig.savefig(paths["memory"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 3.6))
    medians = [r["step_time_s"]["median"] * 1e3 for r in ok]
    low = [m - r["step_time_s"]["min"] * 1e3 for m, r in zip(medians, ok)]
    high = [r["step_time_s"]["max"] * 1e3 - m for m, r in zip(medians, ok)]
    ax.bar(labels, medians, yerr=[low, high], capsize=4, color="#4C72B0")
    ax.set_ylabel("step time, ms (median, min-max)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths["step_time"] = folder / "step_time.png"
    fig.savefig(paths["step_time"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 3.8))
    kinds = sorted({k for r in ok for k in r["comm"]["per_kind"]})
    bottoms = [0.0] * len(ok)
    for kind in kinds:
        values = [get(r, f"comm.per_kind.{kind}.bytes") or 0 for r in ok]
        ax.bar(labels, [v / 1e6 for v in values], bottom=bottoms, label=kind)
        bottoms = [b + v / 1e6 for b, v in zip(bottoms, values)]
    theory = [(get(r, "comm_theory.bytes") or 0) / 1e6 for r in ok]
    ax.scatter(labels, theory, marker="_", s=600, color="black", label="theory", zorder=3)
    ax.set_ylabel("MB per step per rank")
    ax.set_title("Collectives per step by kind (bar) vs ideal (line)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["comm"] = folder / "comm.png"
    fig.savefig(paths["comm"], dpi=110)
    plt.close(fig)
    return paths


def _cell(result_index: int, result: dict, path: str, kind: str) -> str:
    value = get(result, path)
    return (f'<td data-path="results.{result_index}.{path}" data-kind="{kind}">'
            f"{html.escape(fmt(value, kind))}</td>")


def write_html(report: dict, chart_paths: dict[str, Path], path: Path) -> None:
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _, _ in COLUMNS)
    rows = []
    for index, result in enumerate(report["results"]):
        css = "" if result.get("status") == "ok" else ' class="bad"'
        rows.append(f"<tr{css}>" + "".join(_cell(index, result, p, k) for _, p, k in COLUMNS) + "</tr>")
    remarks = "".join(f"<li>{html.escape(line)}</li>" for line in notes(report))
    images = "".join(
        f'<figure id="chart-{name}"><img alt="{html.escape(CHART_TITLES.get(name, name))}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(CHART_TITLES.get(name, name))}</figcaption></figure>"
        for name, p in chart_paths.items())
    comm_rows = []
    for index, result in enumerate(report["results"]):
        for kind, entry in sorted((result.get("comm") or {}).get("per_kind", {}).items()):
            comm_rows.append(f"<tr><td>{html.escape(result['strategy'])}</td><td>{kind}</td>"
                             + _cell(index, result, f"comm.per_kind.{kind}.calls", "int")
                             + _cell(index, result, f"comm.per_kind.{kind}.bytes", "bytes") + "</tr>")
    env = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                  for k, v in report["environment"].items())
    plan = html.escape(json.dumps(report["plan"], indent=1))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardfit bench</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}tr.bad td{{background:#fdd}}
img{{max-width:100%}}figure{{display:inline-block;margin:0 1em 1em 0}}pre{{font-size:11px}}</style></head>
<body data-images="pending">
<h1>shardfit bench: {html.escape(report["plan"]["model"]["name"])}, {report["settings"]["nproc"]} ranks,
{html.escape(str(report["environment"].get("device")))}</h1>
<p>Per rank. Measured on step {report["settings"]["warmup"] - 1 if report["settings"]["warmup"] >= 2 else 0}
(memory, collectives) and {report["settings"]["steps"]} timed steps after {report["settings"]["warmup"]} warm-up steps.
MB = 10<sup>6</sup> bytes. Loss@K: mean over ranks after K steps; vs reference: relative difference to the DDP/fp32 reference.</p>
<table id="summary"><tr>{head}</tr>{"".join(rows)}</table>
<ul id="notes">{remarks}</ul>
<h2>Charts</h2>{images}
<h2>Collectives per step</h2><table id="comm"><tr><th>strategy</th><th>kind</th><th>calls</th><th>bytes</th></tr>
{"".join(comm_rows)}</table>
<h2>Environment</h2><table id="env">{env}</table>
<h2>Plan</h2><pre>{plan}</pre>
<script>window.addEventListener("load", function () {{
  var shown = Array.prototype.filter.call(document.images, function (i) {{ return i.complete && i.naturalWidth > 0; }});
  document.body.setAttribute("data-images", shown.length + "/" + document.images.length);
}});</script>
</body></html>
"""
    path.write_text(page)


def write_all(report: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "report.json", "csv": out / "report.csv", "html": out / "report.html"}
    files["json"].write_text(json.dumps(report, indent=1, default=str))
    write_csv(report, files["csv"])
    chart_paths = charts(report, out / "charts")
    write_html(report, chart_paths, files["html"])
    files.update({f"chart_{name}": p for name, p in chart_paths.items()})
    return files
