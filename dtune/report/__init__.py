"""``dtune report``: one self-contained HTML page of a run folder (data in :mod:`.data`, charts in :mod:`.charts`,
page in :mod:`.html`, the sections assembled in :mod:`.build`)."""

from __future__ import annotations

from .build import NothingToReport, build_report, build_sections, default_output

__all__ = ["NothingToReport", "build_report", "build_sections", "default_output"]
