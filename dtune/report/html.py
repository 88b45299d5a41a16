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
html{overflow-y:scroll}
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#b9c0cc;font-size:13px}
nav{padding:8px 32px;background:#e9ecf1;font-size:13px}nav a{margin-right:14px;color:#2a5db0;text-decoration:none}
main{padding:8px 32px 40px}section{background:#fff;border-radius:6px;padding:14px 20px;margin:16px 0;
box-shadow:0 1px 2px rgba(0,0,0,.08)}h2{font-size:18px;margin:4px 0 10px}
.missing{color:#8a6d00;background:#fff8db;padding:8px 12px;border-radius:4px}
.note{color:#555;font-size:13px}table{border-collapse:collapse;font-size:12px}
th,td{border-bottom:1px solid #e3e6ea;padding:3px 8px;text-align:left;white-space:nowrap}.num{text-align:right}
th{background:#f0f2f5;position:sticky;top:0;cursor:pointer;user-select:none}
td.wrap{white-space:normal;min-width:24em}.scroll{max-height:520px;overflow:auto}
dl{display:grid;grid-template-columns:max-content auto;gap:4px 16px;margin:0 0 8px;font-size:13px}
dt{font-weight:600}dd{margin:0;overflow-wrap:anywhere}
.headline{font-size:16px;font-weight:600;background:#eef4ff;border-left:4px solid #2a5db0;padding:10px 14px;
margin:4px 0 10px}.warning{color:#8a1f11;background:#fdecea;padding:8px 12px;border-radius:4px;font-weight:600}
ul.left-out{font-size:13px;color:#555;margin:4px 0}.chart{width:100%;overflow:hidden}
@media (max-width:760px){header,nav{padding-left:12px;padding-right:12px}main{padding:4px 8px 24px}
section{padding:10px 8px}dl{grid-template-columns:auto}}
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


def cell(x: object) -> str:
    """One table cell's text: numbers by :func:`number`, missing values as a dash."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, (int, float)) or hasattr(x, "dtype"):
        try:
            return number(float(x))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return str(x)
    return str(x)


WRAPPED = ("message", "note")  # long free-text columns: wrapped; every other cell stays on one line


def table_html(frame: pd.DataFrame, sortable: bool = False) -> str:
    """A plain HTML table: numeric columns right-aligned (class ``num``), free text wrapped, every value escaped."""
    numeric = [
        pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c]) for c in frame.columns
    ]
    classes = [
        " class=num" if n else (" class=wrap" if str(c) in WRAPPED else "") for c, n in zip(frame.columns, numeric)
    ]
    head = "".join(f"<th{' class=num' if n else ''}>{html.escape(str(c))}</th>" for c, n in zip(frame.columns, numeric))
    body = []
    for row in frame.itertuples(index=False):
        tds = "".join(f"<td{k}>{html.escape(cell(x))}</td>" for x, k in zip(row, classes))
        body.append(f"<tr>{tds}</tr>")
    cls = ' class="dataframe sortable"' if sortable else ' class="dataframe"'
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


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
        self.parts.append(f'<div class="scroll">{table_html(frame, sortable)}</div>')

    def add_note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def add_headline(self, text: str) -> None:
        """The section's answer in one sentence, set apart."""
        self.parts.append(f'<p class="headline">{html.escape(text)}</p>')

    @staticmethod
    def warning_html(text: str) -> str:
        return f'<p class="warning">{html.escape(text)}</p>'

    def add_warning(self, text: str) -> None:
        self.parts.append(self.warning_html(text))

    def add_list(self, heading: str, items: list[str]) -> None:
        lis = "".join(f"<li>{html.escape(i)}</li>" for i in items)
        self.parts.append(f'<p class="note">{html.escape(heading)}</p><ul class="left-out">{lis}</ul>')

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
