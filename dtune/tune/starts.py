"""Where a shape's study starts: the template's default, the config the ops run at the bucket today, the winners of
the nearest tuned buckets fitted to the shape (shipped configs and ``--transfer-from`` runs,
:mod:`dtune.tune.transfer`), then the space's seeds, and on ``--resume`` the study's best and every config whose trial
never ran to its end (cancelled, interrupted, or its process died)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from dtune.borrow import borrow
from dtune.shape import Shape
from dtune.store import shipped_configs
from dtune.tune import results, transfer
from dtune.tune.bookkeeping import FINISHED, params_key, retryable
from dtune.tune.search_config import SearchConfig
from dtune.tune.strategy import Candidate

__all__ = ["retries", "starting_configs"]


def starting_configs(
    cfg: SearchConfig,
    shape: Shape,
    baseline: dict[str, Any],
    choices: dict[str, tuple[Any, ...]],
    trials: list[FrozenTrial],
) -> list[Candidate]:
    """The default first (always legal: ``--trials 1`` times it); then, unless seeds are off, the config the ops run at
    this bucket on this GPU today (dtune's shipped files: its own entry, a kin GPU's, or the lookup's borrowed one, so
    a search never ships worse than what it replaces without timing it); then the winners of the nearest tuned
    buckets, each fitted to the shape (:func:`fit_donor`) and verbatim (shipped configs unless seeds are off, runs
    given with --transfer-from, and the run folder's own other studies; nearest first: they compile in the first wave
    with the default), then the space's seeds, and on --resume the study's best and its trials to retry (``trials``:
    the study's, read after its stale trials were failed). This study itself is no donor."""
    donors: list[transfer.Donor] = transfer.shipped_donors() if cfg.seeds else []
    for run_dir in cfg.transfer_from:
        donors += transfer.run_donors(Path(run_dir))
    here = (cfg.kernel, cfg.gpu.key, cfg.dtype, shape.bucket())
    donors += [d for d in transfer.run_donors(Path(cfg.out)) if (d.kernel, d.gpu, d.dtype, d.bucket) != here]
    out = [Candidate(dict(baseline), source="default", is_default=True)]

    def transferred(config: dict[str, Any], source: str) -> None:
        """A start from a tuned config (its values the space has, over the default), unless one is already there (a
        donor of the default's own config: the default stands for it)."""
        params = {**baseline, **{n: v for n, v in config.items() if n in choices and v in choices[n]}}
        if all(c.params != params for c in out):
            out.append(Candidate(params, source="transfer:" + source))

    if cfg.seeds:  # what the ops run at this bucket today (on an H100 an H200 entry, read as kin, or a borrowed one)
        shipped = shipped_configs(cfg.gpu.key)
        today = shipped.choose(cfg.kernel, cfg.dtype, shape) if shipped is not None else None
        if today is not None:
            transferred(today.config, "in force " + today.describe())
    for d in transfer.nearest(donors, cfg.kernel, cfg.gpu.key, cfg.dtype, shape, cfg.transfer_count):
        fitted, changes = fit_donor(d, cfg.kernel, shape, cfg.gpu.sm_count)
        transferred(fitted, d.describe() + (f" (fitted: {changes})" if changes else ""))
        if changes:
            transferred(d.config, d.describe() + " (verbatim)")
    if cfg.seeds:
        out += [Candidate({**baseline, **s}, source="seed") for s in cfg.space.seeds]
    if cfg.resume:
        best = results.best_trial(trials)
        if best is not None:
            out.append(Candidate(dict(best.params), source="resume"))
        out += retries(trials)
    return out


def fit_donor(d: transfer.Donor, kernel: str, shape: Shape, sm_count: int) -> tuple[dict[str, Any], str]:
    """A donor's config adjusted to ``shape`` as the lookup adjusts a borrowed one (:func:`dtune.borrow.borrow`:
    tiles cut to the head dims, segments for the shape's sequences and length), and the changes in words ("": none).
    A donor tuned at other head dims is often illegal verbatim (a key tile of 128 at K = 64): fitted, it is a start
    the search can time. A config the template refuses at its own bucket stays as it is."""
    try:
        choice = borrow([d], kernel, d.dtype, shape, sm_count)
    except (ValueError, KeyError, TypeError):  # a config of another template version: pruned or timed as it is
        return dict(d.config), ""
    if choice is None:
        return dict(d.config), ""
    return dict(choice.config), ", ".join(f"{c.param} {c.old}->{c.new}" for c in choice.changes)


def retries(trials: list[FrozenTrial]) -> list[Candidate]:
    """One candidate per config whose trials all ended before running to their end (each config once)."""
    done = {params_key(t.params) for t in trials if t.state in FINISHED and not retryable(t)}
    out = []
    for t in trials:
        if t.state in FINISHED and retryable(t) and params_key(t.params) not in done:
            done.add(params_key(t.params))
            out.append(Candidate(dict(t.params), source="retry"))
    return out
