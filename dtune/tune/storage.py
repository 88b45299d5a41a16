"""Where studies live: one Optuna study per (kernel, GPU, dtype, shape), in any Optuna storage.

Default: SQLite in the run folder. ``--storage URL`` takes any Optuna storage URL (SQLite, PostgreSQL,
MySQL: many workers, GPUs or hosts join one study) or ``journal:PATH`` for a journal file.
"""

from __future__ import annotations

import random
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

JOURNAL_PREFIX = "journal:"
_ATTEMPTS = 5


def study_name(kernel: str, gpu: str, dtype: str, shape_key: str) -> str:
    return f"{kernel}:{gpu}:{dtype}:{shape_key}"


def default_storage_url(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'study.db').resolve()}"


def open_storage(url: str) -> BaseStorage:
    """An Optuna storage for ``url``; ValueError for a URL Optuna cannot open."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if url.startswith(JOURNAL_PREFIX):
            path = Path(url[len(JOURNAL_PREFIX) :]).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        # Several processes on one SQLite file wait for its lock instead of failing.
        kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else {}
        for attempt in range(_ATTEMPTS):
            try:
                return RDBStorage(url, engine_kwargs=kwargs)
            except Exception as e:
                # Workers starting together race to create the schema: the loser retries and finds it made.
                if attempt == _ATTEMPTS - 1:
                    first = (str(e).splitlines() or [type(e).__name__])[0]  # sqlalchemy appends a "Background" line
                    raise ValueError(f"cannot open storage {url!r}: {first}") from None
                time.sleep(0.2 + random.random() * (attempt + 1))
        raise AssertionError("unreachable")
