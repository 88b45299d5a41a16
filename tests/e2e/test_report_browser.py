"""End to end: render the report of a run folder, open it in headless Chromium, check it works offline.

Checks: no remote resources in the HTML; no console messages or uncaught errors while it loads (stderr log and
an in-page trap); every chart div holds plotly's rendered ``svg.main-svg``; at a desktop width (1280 px), a laptop
half-screen (800 px) and a narrow one (520 px; Chromium's window is at least 500 px wide) nothing is wider than the
page and every chart fits its section; from 800 px on, every heatmap cell's text is at least 11 px and fits its cell;
the screenshots are not blank and show the report's colours. The screenshots are kept in the folder
``$DTUNE_E2E_SHOT`` when that is set (to look at them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dtune.report import build_report

from .png import read_png
from .run_folder import make_run_folder

CANDIDATES = (os.environ.get("DTUNE_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome")
CHROMIUM = next((p for p in map(shutil.which, filter(None, CANDIDATES)) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium not found, so the report was not checked in a browser: install it (Debian/Ubuntu: "
    "sudo apt-get install chromium; .ci/run does this) or point DTUNE_CHROMIUM at a Chromium/Chrome binary",
)

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=8000",
]

# Injected first in <head> of the copy under test: console errors/warnings and uncaught exceptions are written
# into the DOM, so --dump-dom shows them whatever Chromium's own logging does.
TRAP = """<script>(function(){var log=[];function keep(k){return function(){log.push(k+': '+
Array.prototype.join.call(arguments,' '));};}console.error=keep('error');console.warn=keep('warn');
window.addEventListener('error',function(e){log.push('uncaught: '+e.message);});
window.addEventListener('unhandledrejection',function(e){log.push('rejection: '+e.reason);});
window.addEventListener('load',function(){var p=document.createElement('pre');p.id='console-trap';
p.textContent=log.join('\\n');document.body.appendChild(p);});})();</script>"""


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


# Injected last in <body>: after plotly has drawn, the page's and every chart's width against the window's, and for
# every heatmap its widest cell text, the pitch of its columns (cell centres) and its smallest font size.
PROBE = """<script>window.addEventListener('load',function(){setTimeout(function(){var o=[];
o.push('window '+window.innerWidth+' page '+document.documentElement.scrollWidth);
document.querySelectorAll('.plotly-graph-div').forEach(function(g){var s=g.closest('section');
o.push('chart '+g.id+' '+Math.round(g.getBoundingClientRect().right)+' '+
Math.round(s.getBoundingClientRect().right));
g.querySelectorAll('g.heatmaplayer').forEach(function(layer){
var texts=Array.prototype.slice.call(layer.querySelectorAll('g.heatmap-label text'));if(!texts.length)return;
var img=layer.querySelector('image');var xs=[];texts.forEach(function(t){var x=+t.getAttribute('x');
if(xs.indexOf(x)<0)xs.push(x);});xs.sort(function(a,b){return a-b;});
var pitch=img?+img.getAttribute('width')/xs.length:1e9;
for(var i=1;i<xs.length;i++)pitch=Math.min(pitch,xs[i]-xs[i-1]);
var widest=0,font=1e9;texts.forEach(function(t){widest=Math.max(widest,t.getBBox().width);
font=Math.min(font,parseFloat(getComputedStyle(t).fontSize));});
o.push('heatmap '+g.id+' '+Math.ceil(widest)+' '+Math.floor(pitch)+' '+font);});});
var p=document.createElement('pre');p.id='probe';p.textContent=o.join('\\n');document.body.appendChild(p);},300);});
</script>"""
WIDTHS = (1280, 800, 520)
READABLE_FROM = 800  # px: from this window width on, every heatmap cell's text fits its cell
MIN_FONT = 11  # px


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    run = make_run_folder(root)
    out, sections = build_report(run, root / "report.html")
    assert all(state == "ok" for state in sections.values()), sections
    return out


def test_report_is_self_contained(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    assert re.search(r"<script[^>]+src=", text) is None, "a <script src=...> would need the network"
    assert re.search(r"<link[^>]+href=[\"']https?:", text) is None
    assert "@import" not in text and "fonts.googleapis" not in text
    charts = re.findall(r'<div id="(chart-[^"]+)" class="plotly-graph-div"', text)
    assert text.count("Plotly.newPlot") == len(charts) >= 9  # every chart of the report
    assert "plotly.js v" in text  # the library itself is inlined


def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    html = report.read_text(encoding="utf-8")
    page = tmp_path / "page.html"
    page.write_text(html.replace("<head>", "<head>" + TRAP, 1), encoding="utf-8")
    chart_ids = re.findall(r'<div id="(chart-[^"]+)" class="plotly-graph-div"', html)
    assert len(chart_ids) >= 9, chart_ids

    done = chromium(["--dump-dom", page.as_uri()], tmp_path / "profile-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], "console output while loading the report:\n" + "\n".join(console)
    trap = re.search(r'<pre id="console-trap">(.*?)</pre>', dom, re.S)
    assert trap is not None, "the page's load event never fired"
    assert trap.group(1).strip() == "", f"console errors: {trap.group(1)}"
    for cid in chart_ids:
        start = dom.index(f'id="{cid}"')
        nxt = dom.find('id="chart-', start + 1)
        segment = dom[start : nxt if nxt > 0 else len(dom)]
        assert "js-plotly-plot" in segment[:400], f"{cid}: plotly did not take over the div"
        assert 'class="main-svg"' in segment, f"{cid}: no rendered svg.main-svg"
        assert "<path" in segment or "<rect" in segment, f"{cid}: nothing drawn"

    shots = Path(os.environ.get("DTUNE_E2E_SHOT") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    for width in WIDTHS:
        shot = shots / f"report-{width}.png"
        args = [f"--window-size={width},2600", f"--screenshot={shot}", page.as_uri()]
        done = chromium(args, tmp_path / f"profile-shot-{width}")
        assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
        img = read_png(shot)[..., :3].astype(np.int32)
        assert img.shape[:2] == (2600, width)
        assert img.std() > 20, f"{width} px: the screenshot is (nearly) blank"
        colours = np.unique(img.reshape(-1, 3), axis=0)
        assert len(colours) > 200, f"{width} px: only {len(colours)} distinct colours: nothing rendered?"
        # The heatmap's and the headline's colours must show at the top of the page: the answer is drawn first.
        headline = (np.abs(img - np.array([0xEE, 0xF4, 0xFF])).sum(axis=-1) < 6).sum()
        assert headline > 2000, f"{width} px: the headline box covers only {headline} pixels"


@pytest.mark.parametrize("width", WIDTHS)
def test_report_fits_the_window(report: Path, tmp_path: Path, width: int) -> None:
    """No horizontal overflow of the page, and no chart wider than its section, at a desktop and a narrow width."""
    page = tmp_path / "probe.html"
    page.write_text(report.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    done = chromium([f"--window-size={width},1600", "--dump-dom", page.as_uri()], tmp_path / "profile-probe")
    assert done.returncode == 0, done.stderr[-2000:]
    probe = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert probe is not None, "the probe never ran"
    lines = probe.group(1).strip().splitlines()
    window, page_width = (int(x) for x in re.findall(r"\d+", lines[0]))
    assert page_width <= window, f"the page is {page_width} px wide in a {window} px window"
    charts = [line.split() for line in lines[1:] if line.startswith("chart ")]
    assert len(charts) >= 9
    for _, cid, right, section_right in charts:
        assert int(right) <= int(section_right), f"{cid} overflows its section at {width} px"
    heatmaps = [line.split() for line in lines[1:] if line.startswith("heatmap ")]
    assert len(heatmaps) >= 3  # prefill, training step, decode
    for _, cid, widest, pitch, font in heatmaps:
        assert float(font) >= MIN_FONT, f"{cid}: cell text of {font} px at {width} px"
        if width >= READABLE_FROM:
            assert int(widest) <= int(pitch) - 3, (
                f"{cid}: a cell's text is {widest} px wide in {pitch} px at {width} px"
            )
