"""Where studies live: one Optuna study per (kernel, GPU, dtype, shape), in any Optuna storage.

Default: SQLite in the run folder. ``--storage URL`` takes any Optuna storage URL (SQLite, PostgreSQL,
MySQL: many workers, GPUs or hosts join one study) or ``journal:PATH`` for a journal file.

RDB storages (SQLite, PostgreSQL, MySQL; not an in-memory SQLite database, which no other process can reach) are
opened with heartbeats: each search process records one for every
trial it runs (:func:`record_heartbeats`, from its loop) and fails the RUNNING trials of processes that stopped
recording (:func:`reap_stale`: killed, or their host lost; beats every ``DTUNE_HEARTBEAT_S`` / 2 = 10 s, stale
after ``DTUNE_HEARTBEAT_GRACE_S`` = 90 s). Such a trial is FAIL without a reason of dtune's:
``trials.csv`` shows it as ``interrupted``, and ``--resume`` retries its config.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, fail_stale_trials
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend
from optuna.trial import Trial
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, make_url

JOURNAL_PREFIX = "journal:"
_ATTEMPTS = 5
# Heartbeats of running trials (RDB storages): recorded every HEARTBEAT_S / 2 by the search loop; a trial without one
# for GRACE_S belongs to a dead process.
HEARTBEAT_S = int(os.environ.get("DTUNE_HEARTBEAT_S", "20"))
GRACE_S = int(os.environ.get("DTUNE_HEARTBEAT_GRACE_S", "90"))


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
        # Several processes on one SQLite file wait for its lock instead of failing. An in-memory SQLite database
        # lives in the connection of the thread that made it (Optuna's heartbeat thread would find an empty one) and
        # no other process can run its trials: no heartbeats there.
        sqlite = url.startswith("sqlite:")
        memory = sqlite and make_url(url).database in (None, "", ":memory:")
        kwargs = {"connect_args": {"timeout": 60}} if sqlite else {}
        beats: dict[str, Any] = {} if memory else {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S}
        for attempt in range(_ATTEMPTS):
            try:
                storage = RDBStorage(url, engine_kwargs=kwargs, **beats)
                if sqlite and not memory:  # a file processes share
                    _lock_on_begin(storage.engine)
                return storage
            except Exception as e:
                # Workers starting together race to create the schema: the loser retries and finds it made.
                if attempt == _ATTEMPTS - 1:
                    first = (str(e).splitlines() or [type(e).__name__])[0]  # sqlalchemy appends a "Background" line
                    raise ValueError(f"cannot open storage {url!r}: {first}") from None
                time.sleep(0.2 + random.random() * (attempt + 1))
        raise AssertionError("unreachable")


def _lock_on_begin(engine: Engine) -> None:
    """Every transaction on this SQLite engine takes the database's write lock when it begins (BEGIN IMMEDIATE).

    Optuna pops an enqueued trial by reading it WAITING and then writing it RUNNING, in one transaction that on
    PostgreSQL or MySQL locks the row (SELECT ... FOR UPDATE). SQLite ignores FOR UPDATE and Python's driver begins
    the transaction only at the write, so two processes could both read the trial WAITING and both run it under one
    number. Taking the lock at BEGIN makes the read and the write one step; the other process waits (``timeout``)."""

    @event.listens_for(engine, "connect")
    def _driver_leaves_transactions_to_us(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections made before the listeners (the schema's) are not reused (an in-memory database
    # would go with them: it has no other process to race, and takes no lock)


def record_heartbeats(study: optuna.Study, trials: Iterable[Trial]) -> None:
    """Record a heartbeat for each of ``trials`` (no-op for storages without heartbeats)."""
    storage = study._storage  # an RDB storage behind Optuna's cache layer, which forwards heartbeats
    if not isinstance(storage, BaseHeartbeat) or storage.get_heartbeat_interval() is None:
        return
    for trial in trials:
        try:
            storage.record_heartbeat(trial._trial_id)
        except Exception:  # a missed beat only risks a late reap; the search goes on
            logging.getLogger(__name__).debug("heartbeat failed", exc_info=True)


def reap_stale(study: optuna.Study) -> None:
    """Fail the RUNNING trials whose process stopped sending heartbeats (no-op without heartbeats)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_stale_trials(study)
    except Exception:  # two processes reaping at once: the loser's update fails harmlessly
        logging.getLogger(__name__).debug("reaping stale trials failed", exc_info=True)
