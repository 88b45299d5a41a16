"""The run folder's ``run.json``: what was tuned, where, with which software (reports and export read it)."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any

from dtune.provenance import git_commit

__all__ = ["RUN_JSON", "STUDY_DB", "TRIALS_CSV", "TUNED_JSON", "git_commit", "now_iso", "read_run_json", "versions"]
__all__ += ["write_run_json"]

RUN_JSON = "run.json"
TRIALS_CSV = "trials.csv"
TUNED_JSON = "tuned.json"
STUDY_DB = "study.db"


def versions() -> dict[str, str]:
    import optuna
    import torch
    import triton

    import dtune

    return {
        "dtune": dtune.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "optuna": optuna.__version__,
        "python": platform.python_version(),
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_run_json(run_dir: Path, info: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_JSON).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def read_run_json(run_dir: Path) -> dict[str, Any]:
    """``run.json`` of a run folder; ValueError if it is missing or unreadable."""
    path = run_dir / RUN_JSON
    try:
        info: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{run_dir} is not a dtune run folder: no {RUN_JSON}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable: {e}") from None
    for key in ("kernel", "gpu", "dtype", "shapes"):
        if key not in info:
            raise ValueError(f"{path} lacks {key!r}")
    return info
