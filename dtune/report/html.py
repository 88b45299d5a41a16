"""HTML rendering: one self-contained page (plotly.js inlined once, no remote scripts or fonts)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#b9c0cc;font-size:13px}
nav{padding:8px 32px;background:#e9ecf1;font-size:13px}nav a{margin-right:14px;color:#2a5db0;text-decoration:none}
main{padding:8px 32px 40px}section{background:#fff;border-radius:6px;padding:14px 20px;margin:16px 0;
box-shadow:0 1px 2px rgba(0,0,0,.08)}h2{font-size:18px;margin:4px 0 10px}
.missing{color:#8a6d00;background:#fff8db;padding:8px 12px;border-radius:4px}
.note{color:#555;font-size:13px}table{border-collapse:collapse;font-size:12px}
th,td{border-bottom:1px solid #e3e6ea;padding:3px 8px;text-align:right;white-space:nowrap}
th{background:#f0f2f5;position:sticky;top:0;cursor:pointer;user-select:none}
td:first-child,th:first-child{text-align:left}td:last-child{white-space:normal}.scroll{max-height:520px;overflow:auto}
dl{display:grid;grid-template-columns:max-content auto;gap:4px 16px;margin:0}dt{font-weight:600}dd{margin:0}
"""

# Click a header to sort by that column (numbers numerically), click again to reverse.
SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th, col){
  th.addEventListener('click', function(){
    var table = th.closest('table'), body = table.tBodies[0];
    var asc = th.dataset.dir !== 'asc'; th.dataset.dir = asc ? 'asc' : 'desc';
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function(a, b){
      var x = a.cells[col].textContent, y = b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? c : -c;
    });
    rows.forEach(function(r){ body.appendChild(r); });
  });
});
"""


def number(x: float) -> str:
    """Whole numbers as integers (registers, bytes), the rest to 4 significant digits (inf and nan as such: a gate
    failure records an infinite error)."""
    if math.isfinite(x) and x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.4g}"


@dataclass
class Section:
    """One part of the page: a chart, a table or a note saying why its data is absent."""

    key: str
    title: str
    parts: list[str] = field(default_factory=list)
    missing: str = ""

    @property
    def state(self) -> str:
        return "ok" if self.parts and not self.missing else (self.missing or "empty")

    def add_figure(self, fig: go.Figure) -> None:
        div_id = f"chart-{self.key}-{len(self.parts)}"
        self.parts.append(
            '<div class="chart">'
            + pio.to_html(
                fig,
                full_html=False,
                include_plotlyjs=False,
                div_id=div_id,
                config={"displaylogo": False, "responsive": True},
            )
            + "</div>"
        )

    def add_table(self, frame: pd.DataFrame, sortable: bool = False) -> None:
        table = frame.to_html(
            index=False,
            na_rep="–",
            border=0,
            classes="sortable" if sortable else "",
            float_format=number,
            escape=True,
        )
        self.parts.append(f'<div class="scroll">{table}</div>')

    def add_note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def add_definitions(self, items: dict[str, str]) -> None:
        rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items.items())
        self.parts.append(f"<dl>{rows}</dl>")

    def render(self) -> str:
        body = "".join(self.parts)
        if self.missing:
            body += f'<p class="missing">{html.escape(self.missing)}</p>'
        return f'<section id="{self.key}"><h2>{html.escape(self.title)}</h2>{body}</section>'


def page(title: str, subtitle: str, sections: list[Section]) -> str:
    """The whole document: inline CSS, plotly.js inlined once in <head>, the sections, the table sorter."""
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p></header><nav>{nav}</nav><main>"
        + "".join(s.render() for s in sections)
        + f"</main><script>{SORT_JS}</script></body></html>\n"
    )
