"""Finished trials as the sweeps write them: point keys, trials added whole, and what a study already holds.

The exhaustive sweep and the bound-pruned sweep evaluate points themselves (no sampler asks), so
each point becomes a finished Optuna trial added with its real start and end time in one storage
write (`add_trial(study, frozen_trial(...))`), with the same attributes as a sampled trial.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..runs import reconcile
from .encoding import SpaceCodec
from .objective import accelerator_fields, jsonable
from .session import REPEAT_ATTR, finished_trials, is_feasible


DESIGN_PREFIX = "design."


def design_attrs(point: dict) -> dict:
    """The design's decoded values as user attributes (`design.num_tc` = 32): Optuna stores each
    parameter encoded (`log2_num_tc` = 5), so these are what optuna-dashboard and
    `trials_dataframe()` show as the design."""
    return {f"{DESIGN_PREFIX}{k}": v for k, v in jsonable(point).items()}


def mark_design(study: optuna.Study, trial: optuna.Trial, point: dict) -> None:
    """Give a sampled trial its decoded design and, when an earlier finished trial sampled the same
    parameters, `repeat_of` = the first such trial (a sampler may propose a design again; it is
    evaluated again, from the caches, and counted in the summary)."""
    for key, value in design_attrs(point).items():
        trial.set_user_attr(key, value)
    same = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
            if t.number < trial.number and t.params == trial.params and not t.user_attrs.get("interrupted")]
    if same:
        trial.set_user_attr(REPEAT_ATTR, min(same))


def point_key(codec: SpaceCodec, point: dict) -> tuple:
    return tuple(sorted(codec.encode(point).items()))


def frozen_trial(codec: SpaceCodec, point: dict, outcome, error: str | None, started: datetime,
                  ended: datetime, result_extra: dict, space=None) -> FrozenTrial:
    params = codec.encode(point)
    dists = {k: v for k, v in codec.distributions().items()}
    user_attrs = {"point": jsonable(point), **design_attrs(point)}
    system_attrs = {}
    if error is not None:
        user_attrs["result"] = {"error": error, **result_extra}
        if "accelerator" not in user_attrs["result"]:
            user_attrs["result"]["accelerator"] = accelerator_fields(space, point) if space is not None else {}
        state, values = TrialState.FAIL, None
    else:
        user_attrs["result"] = {**outcome.result_attr(), **result_extra}
        state, values = TrialState.COMPLETE, list(outcome.values)
        for key, value in outcome.constraints.items():
            system_attrs[f"constraints:{key}"] = float(value)
    return FrozenTrial(number=0, state=state, value=None, values=values, datetime_start=started,
                       datetime_complete=ended, params=params, distributions=dists, user_attrs=user_attrs,
                       system_attrs=system_attrs, intermediate_values={}, trial_id=0)


def add_trial(study: optuna.Study, trial: FrozenTrial) -> FrozenTrial:
    """Add a finished trial and return it as stored (with its study-wide number)."""
    storage = study._storage  # noqa: SLF001 - add_trial does not return the new trial's number
    reconcile.stamp(trial.system_attrs)  # who ran it (see `reconcile`)
    trial_id = storage.create_new_trial(study._study_id, template_trial=trial)  # noqa: SLF001
    return storage.get_trial(trial_id)


def existing_scores(session_or_study, codec: SpaceCodec) -> dict:
    """Point key -> score of every finished trial (0.0 infeasible, None failed): what a resumed sweep skips."""
    done = {}
    for t in finished_trials(session_or_study.get_trials(deepcopy=False)):
        point = t.user_attrs.get("point")
        if point is None:
            continue
        try:
            key = point_key(codec, point)
        except ValueError:
            continue
        done[key] = (t.values[0] if is_feasible(t) else 0.0) if t.state == TrialState.COMPLETE else None
    return done


def best_history(trials: Iterable) -> list[dict]:
    """Each time the best feasible score improved, in wall-clock order: trial, elapsed_s, score."""
    rows = []
    for t in trials:
        if not is_feasible(t):
            continue
        e = (t.user_attrs.get("result") or {}).get("elapsed_s")
        rows.append((float(e) if isinstance(e, (int, float)) else float("inf"), t.number, t.values[0]))
    rows.sort()
    history, best = [], None
    for elapsed, number, score in rows:
        if best is None or score > best:
            best = score
            history.append({"trial": number, "elapsed_s": elapsed, "score": score})
    return history
