"""The HTML report opened in headless Chromium: it renders, logs no console error, shows its
three charts, and every number in it equals report.json."""
from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self._open, self.body = [], None, {}
        self.captions, self._caption = [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if tag == "figcaption":
            self._caption = ""
        if tag == "td" and "data-path" in attrs:
            self._open = [attrs["data-path"], attrs["data-kind"], ""]

    def handle_data(self, data):
        if self._caption is not None:
            self._caption += data
        if self._open is not None:
            self._open[2] += data

    def handle_endtag(self, tag):
        if tag == "figcaption" and self._caption is not None:
            self.captions.append(self._caption)
            self._caption = None
        if tag == "td" and self._open is not None:
            self.cells.append(tuple(self._open))
            self._open = None


def _chromium_dom(page, tmp_path):
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/ci-deps.sh installs it in CI)")
def test_html_report_renders_in_chromium_and_shows_the_json_numbers(bench_run, tmp_path):
    from shardfit.bench.report import fmt, get

    page = bench_run["out"] / "report.html"
    proc = _chromium_dom(page, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    parser = _Cells()
    parser.feed(proc.stdout)
    # The inline script ran after load and every base64 chart decoded into an image.
    assert parser.body.get("data-images") == "3/3", parser.body
    report = bench_run["report"]
    assert len(parser.cells) > 20 * len(report["results"]) // 2
    for path, kind, text in parser.cells:
        assert text == fmt(get(report, path), kind), (path, text)
    assert re.search(r"tiny-llama", proc.stdout)
    # A figure that must be real: DDP's measured all-reduce, as bytes in the comm table.
    ddp_index = next(i for i, r in enumerate(report["results"]) if r["strategy"] == "ddp")
    shown = dict(((p, t) for p, _, t in parser.cells))
    assert shown[f"results.{ddp_index}.comm.per_kind.all_reduce.bytes"] == \
        fmt(report["results"][ddp_index]["comm"]["per_kind"]["all_reduce"]["bytes"], "bytes")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/ci-deps.sh installs it in CI)")
def test_chart_captions_are_titles_not_ids(tmp_path):
    from launch import shardfit

    from shardfit.bench.report import CHART_TITLES

    out = tmp_path / "bench"
    shardfit("bench", "--strategies", "ddp", "--steps", "2", "--warmup", "2", "--no-checkpoint", "--out", str(out),
             timeout=300)
    proc = _chromium_dom(out / "report.html", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parser = _Cells()
    parser.feed(proc.stdout)
    assert parser.body.get("data-images") == "3/3", parser.body  # every chart decoded and shown
    assert parser.captions == [CHART_TITLES[name] for name in ("memory", "step_time", "comm")]
    assert not {"memory", "step_time", "comm"} & {c.strip() for c in parser.captions}
    assert all(len(c.split()) >= 4 for c in parser.captions), parser.captions  # words a reader reads


def test_an_oom_strategy_is_explained_once_with_sized_changes(tmp_path):
    """One strategy given a 1000-byte budget: the bench notes carry profile's diagnosis of the worst
    rank (every rank ran out), once, with each change's flags and predicted peak."""
    import json

    from launch import shardfit

    out = tmp_path / "bench"
    done = shardfit("bench", "--strategies", "fsdp2", "--budget-bytes", "1KB", "--steps", "2", "--warmup", "2",
                    "--no-checkpoint", "--out", str(out), timeout=300, check=False)
    result = json.loads((out / "report.json").read_text())["results"][0]
    assert result["status"] == "oom", result
    diagnosis = result["diagnosis"]
    assert diagnosis["phase"] == "forward" and diagnosis["limit_bytes"] == 1000 and diagnosis["live"]["params"] > 0
    assert diagnosis["fixes"] and all(f["flags"] and f["peak_bytes"] > 0 for f in diagnosis["fixes"])
    assert done.stdout.count("OUT OF MEMORY on rank") == 1 and "smallest changes (estimator):" in done.stdout
    assert "[--ac full | plan: training.activation_checkpointing: full]" in done.stdout
