"""Plotly figures, one per chart of the report, each drawn from the frame :mod:`dtune.report.data` shapes.

Every axis names its unit. Legends sit under the plot (the plot keeps the page's width on a narrow screen), one
figure per kernel where a kernel's scale differs (no shared facet axes whose titles overlap).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dtune.measure.work import Roofs

from . import data as d

# At the bottom of the figure (container coordinates): rotated tick labels and axis titles push the plot up, never
# into the legend.
LEGEND_BELOW = {"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0, "x": 0, "xanchor": "left"}
LAYOUT = {"template": "plotly_white", "height": 440, "margin": {"l": 70, "r": 20, "t": 60, "b": 40}}


def _styled(fig: go.Figure, title: str, height: int | None = None) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left"}, legend=LEGEND_BELOW, legend_title_text="", **LAYOUT
    )
    if height is not None:
        fig.update_layout(height=height)
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return fig


CELL_FONT = 12  # px: the heatmaps' cell text, fixed (plotly would shrink it to fit: unreadable at 800 px)


def versus_heatmap(frame: pd.DataFrame, against: str, title: str | None = None) -> go.Figure:
    """Rows op × head dim (× grouped heads, batch, mode), columns ``col`` in ``col_order`` (sequence lengths then
    packed batches, decode batches, training shapes: :func:`dtune.report.data.heatmap_rows`); colour: the time ratio
    on a log scale, centred on 1× (blue: dtune faster, red: slower). Each cell: the ratio (``†``: an untuned bucket),
    dtune's ms, the other's ms, in three short lines that stay readable in a narrow window."""
    frame = frame.assign(row=frame["row"].str.replace(" ", "<br>", n=1, regex=False))  # op over its shape
    rows = list(dict.fromkeys(frame["row"]))
    cols = list(dict.fromkeys(frame.sort_values("col_order")["col"]))
    z = np.full((len(rows), len(cols)), np.nan)
    text = np.full((len(rows), len(cols)), "", dtype=object)
    hover = np.full((len(rows), len(cols)), "", dtype=object)
    other = "fla" if against == "fla" else "default"
    for r in frame.to_dict("records"):
        i, j = rows.index(r["row"]), cols.index(r["col"])
        mark = f" {d.UNTUNED}" if r.get("untuned") else ""
        z[i, j] = math.log2(r["ratio"])
        text[i, j] = f"<b>{r['ratio']:.2f}×{mark}</b><br>{r['dtune_ms']:#.3g} ms<br>vs {r['other_ms']:#.3g}"
        source = {"borrowed": "untuned bucket: config borrowed", "default": "untuned: the default config"}
        hover[i, j] = (
            f"{r['kernel']} {d.shape_label(r)} {r['mode']}<br>dtune {r['dtune_ms']:.4g} ms, {r['other']} "
            f"{r['other_ms']:.4g} ms: {r['ratio']:.3f}×" + (f"<br>{source[r['match']]}" if r.get("untuned") else "")
        )
    span = max(1.0, float(np.nanmax(np.abs(z)))) if np.isfinite(z).any() else 1.0
    ticks = [t for t in (-2, -1, -0.5, 0, 0.5, 1, 2) if abs(t) <= span]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=cols,
            y=rows,
            text=text,
            texttemplate="%{text}",
            textfont={"size": CELL_FONT},
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
            colorscale="RdBu",
            zmid=0,
            zmin=-span,
            zmax=span,
            xgap=3,
            ygap=3,
            colorbar={
                "title": {"text": "×"},
                "tickvals": ticks,
                "ticktext": [f"{2**t:.2g}×" for t in ticks],
                "thickness": 12,
            },
        )
    )
    fig.update_xaxes(title="", type="category", side="top", tickfont={"size": CELL_FONT})
    fig.update_yaxes(title="", type="category", autorange="reversed", tickfont={"size": CELL_FONT})
    height = 120 + 66 * len(rows)
    fig = _styled(fig, title or f"Time ratio, {other} / dtune", height)
    fig.update_layout(margin={"l": 10, "r": 10, "t": 80, "b": 10})
    return fig


def speedup_lines(frame: pd.DataFrame, axis: str, against: str) -> go.Figure:
    """Speedup against sequence length (``axis="T"``) or head dim (``"K"``), one line per kernel and the other
    dimension, a dotted line at 1×."""
    fig = px.line(
        frame, x="x", y="speedup", color="line", markers=True, hover_data={"dtune_ms": ":.4g", "other_ms": ":.4g"}
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    if axis == "T":
        ticks = sorted(int(t) for t in frame["x"].unique())
        fig.update_xaxes(title="sequence length T (tokens, log scale)", type="log", tickvals=ticks, ticktext=ticks)
    else:
        dims = sorted(int(k) for k in frame["x"].unique())
        fig.update_xaxes(title="head dim D = K = V", type="category", categoryorder="array", categoryarray=dims)
    fig.update_yaxes(title=f"speedup vs {against} (×)", rangemode="tozero")
    what = "sequence length" if axis == "T" else "head dim"
    return _styled(fig, f"vs {'fla (fastest mode)' if against == 'fla' else 'the default'}, by {what}")


def stage_floors(frame: pd.DataFrame) -> go.Figure:
    """Each stage's measured time beside its floor (grouped horizontal bars, ms), the ratio written on the bar."""
    frame = frame.assign(label=frame["label"].str.replace(" · ", "<br>", regex=False))  # shape over stage
    labels = list(dict.fromkeys(frame["label"]))
    fig = go.Figure()
    ratio = [f"{x:.1f}× floor" if pd.notna(x) else "no floor" for x in frame["x_floor"]]
    fig.add_trace(
        go.Bar(
            y=frame["label"],
            x=frame["measured_ms"],
            orientation="h",
            name="measured",
            text=ratio,
            textposition="outside",
            cliponaxis=False,
            marker_color="#2E6FD8",
        )
    )
    if frame["floor_ms"].notna().any():
        fig.add_trace(
            go.Bar(y=frame["label"], x=frame["floor_ms"], orientation="h", name="floor", marker_color="#B9C3CF")
        )
    fig.update_layout(barmode="group", bargap=0.25)
    fig.update_xaxes(title="time per call (ms)", range=[0, float(frame["measured_ms"].max()) * 1.35])
    fig.update_yaxes(title="", categoryorder="array", categoryarray=labels[::-1])
    return _styled(fig, "Time vs floor, per stage", 150 + 52 * len(labels))


IMPL_COLORS = {"tuned": "#2E6FD8", "default": "#F28E2B", "fla": "#59A14F", "fla_fast": "#8CD17D", "torch": "#9C9C9C"}


def impl_color(series: str) -> str:
    """One colour per implementation in every chart (its graph-replay series a darker shade of the same hue)."""
    base = IMPL_COLORS.get(series.split(" ")[0], "#B07AA1")
    if "(graph)" not in series:
        return base
    r, g, b = (int(base[i : i + 2], 16) * 6 // 10 for i in (1, 3, 5))
    return f"#{r:02x}{g:02x}{b:02x}"


def bench_times(frame: pd.DataFrame, kernel: str) -> go.Figure:
    """One kernel's median time per call for each implementation, grouped by shape (linear, from zero)."""
    fig = px.bar(
        frame,
        x="shape",
        y="median_ms",
        color="series",
        color_discrete_map={s: impl_color(str(s)) for s in frame["series"].unique()},
        barmode="group",
        hover_data={"speedup_vs_default": ":.3f", "speedup_vs_fla": ":.3f", "meaningful": True},
    )
    fig.update_yaxes(title="median time per call (ms)", rangemode="tozero")
    fig.update_xaxes(title="shape (B batch, T tokens, H heads, D head dim)")
    return _styled(fig, f"{kernel} (lower is better)", 400)


def roofline(points: pd.DataFrame, roof_list: list[Roofs]) -> go.Figure:
    """Achieved TFLOP/s against nominal arithmetic intensity, with the roofs; axes clipped to the data."""
    lo = 10 ** (math.floor(math.log10(max(points["intensity"].min(), 1e-3))) - 0.3)
    top = max([points["intensity"].max(), *(r.ridge for r in roof_list), 1.0])
    hi = 10 ** (math.ceil(math.log10(top)) + 0.3)
    fig = go.Figure()
    lines = d.roof_lines(roof_list, lo, hi)
    for i, (name, grp) in enumerate(lines.groupby("roof", sort=False) if len(lines) else []):
        style = {"dash": "dash" if i else "solid", "color": "#333" if i else "#999", "width": 2}
        fig.add_trace(go.Scatter(x=grp["intensity"], y=grp["tflops"], mode="lines", name=str(name), line=style))
    palette = px.colors.qualitative.Dark24
    for i, (name, grp) in enumerate(points.groupby("group", sort=True)):
        symbol = "diamond" if str(name).startswith("profile") else "circle"
        fig.add_trace(
            go.Scatter(
                x=grp["intensity"],
                y=grp["tflops"],
                mode="markers",
                name=str(name),
                text=grp["label"],
                marker={"size": 10, "symbol": symbol, "color": palette[i % len(palette)], "opacity": 0.85},
                hovertemplate="%{text}<br>%{x:.1f} FLOP/B, %{y:.2f} TFLOP/s<extra></extra>",
            )
        )
    y_lo = max(points["tflops"].min() / 3, 1e-3)
    y_hi = max([points["tflops"].max(), *(r.tflops for r in roof_list)]) * 2
    fig.update_xaxes(
        type="log", range=[math.log10(lo), math.log10(hi)], exponentformat="none",
        title="arithmetic intensity (nominal FLOP per compulsory byte)",
    )  # fmt: skip
    fig.update_yaxes(
        type="log", range=[math.log10(y_lo), math.log10(y_hi)], exponentformat="none", title="achieved TFLOP/s"
    )
    return _styled(fig, "Roofline", 480)


def search_history(frame: pd.DataFrame) -> go.Figure:
    """Each study's best time so far relative to its first trial (the default config), so studies of different
    scales share one axis; the trials themselves as faint dots (those slower than 1.5× are off the chart)."""
    fig = go.Figure()
    palette = px.colors.qualitative.Plotly
    for i, (label, grp) in enumerate(frame.groupby("label", sort=True)):
        color = palette[i % len(palette)]
        fig.add_trace(
            go.Scatter(
                x=grp["number"],
                y=grp["best_relative"],
                customdata=grp["best_so_far"],
                mode="lines",
                name=str(label),
                line={"shape": "hv", "color": color, "width": 2},
                legendgroup=str(label),
                hovertemplate="trial %{x}: best %{customdata:.4g} ms (%{y:.3f}× the first)<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=grp["number"],
                y=grp["relative"],
                customdata=grp["time_ms"],
                mode="markers",
                name=f"{label}: trials",
                opacity=0.45,
                marker={"size": 6, "color": color},
                legendgroup=str(label),
                showlegend=False,
                hovertemplate="trial %{x}: %{customdata:.4g} ms (%{y:.3f}× the first)<extra></extra>",
            )
        )
    low = float(frame["best_relative"].min())
    fig.update_xaxes(title="trial number (in each study)")
    fig.update_yaxes(title="time / first trial's time (×)", range=[min(0.9, low - 0.05), 1.5])
    return _styled(fig, "Search history: best so far (lines), trials (dots)")


def failures(frame: pd.DataFrame) -> go.Figure:
    fig = px.bar(frame, x="reason", y="count", color="state", text="count")
    fig.update_traces(textposition="outside", cliponaxis=False)
    fig.update_yaxes(title="trials")
    fig.update_xaxes(title="reason")
    return _styled(fig, "Trials lost, by reason", 360)


SEGMENT_NAME = 48  # legend entries are cut here (PyTorch's kernels have templated names of 200 characters)


def launch_segments(frame: pd.DataFrame, group: str) -> go.Figure:
    """One call (kernel, head dim, shape, mode), each contestant's time per call as a stacked bar of its launches
    (dtune's by stage, a peer's by kernel), with the whole call's median (◆) and the whole op's floor (|) marked."""
    frame = frame.sort_values("order", kind="stable")
    impls = list(dict.fromkeys(frame["impl"]))
    fig = go.Figure()
    for segment, part in frame.groupby("segment", sort=False):
        fig.add_trace(
            go.Bar(
                y=part["impl"],
                x=part["ms"],
                name=str(segment) if len(str(segment)) <= SEGMENT_NAME else str(segment)[: SEGMENT_NAME - 1] + "…",
                orientation="h",
                hovertemplate=f"{segment}<br>%{{y}}: %{{x:.4g}} ms<extra></extra>",
            )
        )
    whole = frame.drop_duplicates("impl")
    fig.add_trace(
        go.Scatter(
            y=whole["impl"], x=whole["call_ms"], mode="markers", name="whole call (median)",
            marker={"symbol": "diamond", "size": 10, "color": "#1d2330"},
            hovertemplate="%{y}: whole call %{x:.4g} ms<extra></extra>",
        )
    )  # fmt: skip
    floors = whole[whole["floor_ms"].notna()]
    if len(floors):
        fig.add_trace(
            go.Scatter(
                y=floors["impl"], x=floors["floor_ms"], mode="markers", name="the op's floor",
                marker={"symbol": "line-ns-open", "size": 18, "line": {"width": 3}, "color": "#8a1f11"},
                hovertemplate="floor of the whole op: %{x:.4g} ms<extra></extra>",
            )
        )  # fmt: skip
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="device time per call (ms)", rangemode="tozero")
    fig.update_yaxes(title="", type="category", categoryorder="array", categoryarray=impls[::-1])
    return _styled(fig, f"{group}: where the time goes", 260 + 40 * len(impls))
