"""Where studies live: one Optuna study per (kernel, GPU, dtype, shape), in any Optuna storage.

Default: SQLite in the run folder. ``--storage URL`` takes any Optuna storage URL (SQLite, PostgreSQL,
MySQL: many workers, GPUs or hosts join one study) or ``journal:PATH`` for a journal file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

JOURNAL_PREFIX = "journal:"


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
        try:
            if url.startswith("sqlite:"):
                # Several processes on one SQLite file: wait for the lock instead of failing.
                return RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
            return RDBStorage(url)
        except Exception as e:
            raise ValueError(f"cannot open storage {url!r}: {e}") from None
