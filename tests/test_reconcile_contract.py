"""The contract `runs.reconcile.install_claim_hooks` takes from Optuna's private RDB layout, pinned.

The hooks write a trial's owner in the very transaction that makes it RUNNING: SQLAlchemy ORM events
on `optuna.storages._rdb.models.TrialModel` that insert into `TrialSystemAttributeModel`'s table.
Optuna offers no public hook at that moment (a trial user attribute or a storage wrapper writes a
moment later, in another transaction, and a kill in between leaves a RUNNING trial with no owner).
If an Optuna release renames those models, their columns or the way `ask` creates or pops a trial,
the hooks would go quiet (`claim` would still write a moment later): these tests fail first.
"""

from __future__ import annotations

import optuna
import pytest

from phaze_opt.runs import reconcile


def test_the_private_models_hold_what_the_hooks_read():
    from optuna.storages._rdb import models

    trial_columns = set(models.TrialModel.__table__.c.keys())
    assert {"trial_id", "state"} <= trial_columns
    attrs = models.TrialSystemAttributeModel.__table__
    assert {"trial_id", "key", "value_json"} <= set(attrs.c.keys())
    assert attrs.c.value_json.type.python_type is str  # the owner is stored as JSON text


@pytest.fixture
def owned(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    session = reconcile.new_session()  # installs the hooks
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'contract.db'}")
    yield session, storage
    reconcile.end_session()


def test_a_trial_is_owned_as_it_becomes_running_without_claim(owned):
    """Both ways `ask` makes a RUNNING trial: a new row (insert) and a queued one popped (update;
    queued here outside any invocation, so only the update can own it)."""
    session, storage = owned
    study = optuna.create_study(study_name="c", storage=storage)
    fresh = study.ask()
    reconcile.end_session()
    study.enqueue_trial({"x": 1.0})
    assert reconcile.OWNER_ATTR not in study.get_trials(deepcopy=False)[-1].system_attrs
    session = reconcile.new_session()
    popped = study.ask()
    assert popped.number == 1  # the queued trial, not a new one
    for trial in (fresh, popped):
        owner = storage.get_trial_system_attrs(trial._trial_id)[reconcile.OWNER_ATTR]  # noqa: SLF001
        assert owner["pid"] == reconcile.me()["pid"]
    assert storage.get_trial_system_attrs(popped._trial_id)[reconcile.OWNER_ATTR]["session"] == session  # noqa: SLF001


def test_outside_an_invocation_the_hooks_write_nothing(owned):
    _, storage = owned
    reconcile.end_session()
    trial = optuna.create_study(study_name="d", storage=storage).ask()
    assert reconcile.OWNER_ATTR not in storage.get_trial_system_attrs(trial._trial_id)  # noqa: SLF001
