"""What ``dtune bench`` and ``dtune profile`` write: a table as ``<stem>.csv`` and ``<stem>.json`` (records)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def write_table(frame: pd.DataFrame, out_dir: str | Path, stem: str) -> tuple[Path, Path]:
    """``<stem>.csv`` and ``<stem>.json`` (records) of ``frame`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    frame.to_csv(csv_path, index=False)
    frame.to_json(json_path, orient="records", indent=1)
    return csv_path, json_path
