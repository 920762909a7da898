"""`compare`: best-so-far curves, the 99% table, outputs and MLflow logging."""

import csv
import io
import json
from datetime import datetime, timedelta

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState

from phaze_opt.errors import PhazeError
from phaze_opt.experiments.convergence import (compare, curve_from_trials, load_curve, plot, resolve_study, rows_csv,
                                               rows_markdown, table, verdict)
from phaze_opt.search.report import render
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import default_study_name
from test_study_fakes import FakeSpace, InterruptAfter, backend, config, mlflow_uri


class T:
    """The parts of a FrozenTrial the comparison reads."""

    def __init__(self, number, value, elapsed, feasible=True, failed=False):
        self.number = number
        self.state = TrialState.FAIL if failed else TrialState.COMPLETE
        self.values = None if failed else [value]
        self.constraints = {"area": -0.5 if feasible else 0.5, "memory": 0.0}
        self.user_attrs = {"result": {"elapsed_s": elapsed}}
        self.system_attrs = {}
        self.datetime_start = self.datetime_complete = None


def test_table_by_hand():
    a = curve_from_trials("a", "", [T(0, 10, 1.0), T(1, 50, 2.0), T(2, 99, 3.0, feasible=False), T(3, 98, 5.0)], {})
    b = curve_from_trials("b", "", [T(0, 100, 10.0), T(1, 1, 20.0, failed=True)], {"mode": "exhaustive"})
    rows, target = table([a, b], 0.99)
    assert target == pytest.approx(99.0)
    ra, rb = rows
    # a's best is 98 (the 99 was infeasible): it never reaches 99% of b's 100
    assert (ra["best_score"], ra["best_trial"], ra["trials"], ra["wall_s"]) == (98, 3, 4, 5.0)
    assert ra["trials_to_target"] is None and ra["time_to_target_s"] is None
    assert ra["best_vs_overall"] == pytest.approx(0.98)
    assert (rb["best_score"], rb["trials"], rb["trials_to_target"], rb["time_to_target_s"]) == (100, 2, 1, 10.0)
    rows, target = table([a, b], 0.95)
    assert (rows[0]["trials_to_target"], rows[0]["time_to_target_s"]) == (4, 5.0)
    text = rows_csv(rows, 0.95)
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert parsed[0]["trials_to_95pct"] == "4" and parsed[1]["time_to_95pct_s"] == "10.0"


def test_out_of_order_completion_is_sorted_by_wall_clock():
    c = curve_from_trials("w", "", [T(0, 5, 9.0), T(1, 7, 1.0), T(2, 6, 2.0)], {})
    assert c.steps == [(1.0, 1, 7), (2.0, 2, 7), (9.0, 3, 7)] and c.best_trial == 1


runs = st.lists(st.tuples(st.floats(0, 1000, allow_nan=False), st.floats(0, 100, allow_nan=False), st.booleans()),
                min_size=0, max_size=15)


@settings(max_examples=150, deadline=None)
@given(st.lists(runs, min_size=2, max_size=3), st.sampled_from([0.5, 0.9, 0.99, 1.0]))
def test_reach_matches_brute_force(studies, threshold):
    curves = []
    for i, rows in enumerate(studies):
        trials = [T(n, v, e, feasible=ok) for n, (e, v, ok) in enumerate(rows)]
        curves.append(curve_from_trials(f"s{i}", "", trials, {}))
    out, target = table(curves, threshold)
    bests = [max([v for e, v, ok in rows if ok], default=None) for rows in studies]
    top = max([b for b in bests if b is not None], default=None)
    expected_target = threshold * top if top else None
    assert target == expected_target
    for rows, row, best in zip(studies, out, bests):
        assert row["best_score"] == best and row["trials"] == len(rows)
        order = sorted(range(len(rows)), key=lambda n: (rows[n][0], n))
        hit = None
        if target is not None:
            for rank, n in enumerate(order, 1):
                seen = [rows[m][1] for m in order[:rank] if rows[m][2]]
                if seen and max(seen) >= target:
                    hit = (rank, rows[n][0])
                    break
        assert (row["trials_to_target"], row["time_to_target_s"]) == (hit if hit else (None, None))


def tiny_space():
    return FakeSpace(params={"num_tc": [2, 4], "tc_x": [8, 16], "glb_mib": [4], "hbm_gib": [32], "mbs": [1, 2],
                             "recompute": [False, True]})  # 16 points


@pytest.fixture(scope="module")
def two_studies(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cmp")
    uri = mlflow_uri(tmp)
    sampled = config(tmp, trials=8, storage=None, tracking_uri=uri)
    exhaustive = config(tmp, strategy="auto", storage=None, tracking_uri=uri)
    run_study(sampled, backend(tiny_space()))
    run_study(exhaustive, backend(tiny_space()))
    return tmp, uri, default_study_name(sampled), default_study_name(exhaustive)


def test_compare_writes_table_plot_and_logs_to_mlflow(two_studies):
    tmp, uri, a, b = two_studies
    out = str(tmp / "studies")
    result = compare([a, b], out_dir=out, tracking_uri=uri)
    rows = list(csv.DictReader(open(result["csv"])))
    assert [r["study"] for r in rows] == [a, b]
    ex = optuna.load_study(study_name=b, storage=f"sqlite:///{out}/{b}.db")
    best = max(t.values[0] for t in ex.trials if t.state == TrialState.COMPLETE and t.constraints["area"] <= 0
               and t.constraints["memory"] <= 0)
    assert float(rows[1]["best_score"]) == pytest.approx(best)  # the exhaustive study has the true optimum
    assert rows[1]["trials"] == str(len(ex.trials)) and rows[1]["mode"] == "exhaustive"
    assert float(rows[0]["best_score"]) <= best
    assert open(result["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(result["markdown"]).read()
    assert a in md and "trials to 99%" in md
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(result["mlflow"]["run_id"])
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {p.split("/")[-1] for p in (result["csv"], result["markdown"], result["plot"])} <= names
    assert run.data.metrics[f"{b}.best_score"] == pytest.approx(best)


def test_compare_bad_input(two_studies, tmp_path):
    tmp, _, a, b = two_studies
    out = str(tmp / "studies")
    for args, msg in [([a], "at least two"), ([a, "nope"], "unknown study 'nope'"), ([a, a], "named twice")]:
        with pytest.raises(PhazeError, match=msg) as info:
            compare(args, out_dir=out, tracking_uri="off")
        assert "\n" not in str(info.value)
    with pytest.raises(PhazeError, match="threshold"):
        compare([a, b], out_dir=out, tracking_uri="off", threshold=1.5)
    # a study of other models is not comparable
    other = config(tmp_path, trials=3, storage=None, models=("m-big",))
    run_study(other, backend(tiny_space()))
    other_url = f"sqlite:///{tmp_path / 'studies' / default_study_name(other)}.db"
    assert resolve_study(str(tmp_path / "studies" / f"{default_study_name(other)}.db"), None) == (
        default_study_name(other), other_url)
    with pytest.raises(PhazeError, match="different models"):
        compare([str(tmp / "studies" / f"{a}.db"), str(tmp_path / "studies" / f"{default_study_name(other)}.db")],
                out_dir=str(tmp_path), tracking_uri="off")


def test_elapsed_falls_back_to_optuna_timestamps(tmp_path):
    url = f"sqlite:///{tmp_path}/x.db"
    study = optuna.create_study(study_name="foreign", storage=url, direction="maximize")
    t0 = datetime(2024, 1, 1)
    for i, v in enumerate([3.0, 1.0, 8.0]):
        study.add_trial(optuna.trial.create_trial(value=v, params={}, distributions={}))
    trials = study.get_trials()
    for t, s in zip(trials, [0, 10, 30]):
        t.datetime_start, t.datetime_complete = t0 + timedelta(seconds=s), t0 + timedelta(seconds=s + 5)
    c = curve_from_trials("foreign", url, trials, {})
    assert [s[0] for s in c.steps] == [5.0, 15.0, 35.0] and c.best == 8.0


def _figure_of(monkeypatch):
    """Capture the figure `plot` saves, so a test can look at every mark on its axes."""
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig

    def savefig(fig, *args, **kw):
        saved.append(fig)
        return real(fig, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_plot_labels_every_mark_and_shades_the_bounding_phase(tmp_path, monkeypatch):
    sampled = curve_from_trials("tpe", "", [T(0, 50, 2.0), T(1, 99.5, 8.0), T(2, 70, 9.0)],
                                {"mode": "sampled", "sampler": "tpe", "workers_per_run": [1], "wall_s": 10.0})
    swept = curve_from_trials("sweep", "", [T(0, 90, 6.0), T(1, 100, 7.0)],
                              {"mode": "exhaustive", "sampler": "exhaustive", "workers_per_run": [1, 2],
                               "bounding_phases": [[0.0, 5.0]], "wall_s": 7.5,
                               "exhaustive_status": {"optimum_proven": True}})
    assert (sampled.wall_s, swept.wall_s) == (10.0, 7.5)  # the stored wall time, not the last trial's
    assert (sampled.workers_text, swept.workers_text) == ("1", "1/2")
    _, target = table([sampled, swept], 0.99)
    saved = _figure_of(monkeypatch)
    labels = plot([sampled, swept], target, tmp_path / "p.png", "t", threshold=0.99)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert labels == [
        "tpe (sampled (tpe), 1 worker): best so far, to its wall time 10.0 s",
        "tpe: time to 99% of the optimum (8.0 s, 2 trials)",
        "sweep: bounding (no design evaluated yet)",
        "sweep (exhaustive, 1/2 workers): best so far, to its wall time 7.5 s",
        "sweep: time to 99% of the optimum (7.0 s, 2 trials)",
        "target: 99% of the optimum (99)",
    ]
    ax = saved[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    # every mark drawn has its legend entry: curves, dots, the target line, the shaded phase
    marks = [a for a in [*ax.lines, *ax.patches, *ax.collections]]
    assert len(marks) == len(labels) and all(not a.get_label().startswith("_") for a in marks)
    span = next(p for p in ax.patches if "bounding" in p.get_label())
    assert (span.get_x(), span.get_x() + span.get_width()) == (0.0, 5.0)
    # a sampled study alone: no shaded phase; not an exhaustive optimum, so "the best found"
    saved.clear()
    _, target = table([sampled], 0.99)
    labels = plot([sampled], target, tmp_path / "q.png", "t")
    assert not saved[0].axes[0].patches and not any("bounding" in x for x in labels)
    assert "target: 99% of the best found (98.505)" in labels


def test_compare_wall_time_and_workers_are_the_studys_own(two_studies):
    tmp, _, a, b = two_studies
    out = tmp / "studies"
    result = compare([a, b], out_dir=str(out), tracking_uri="off", name="own")
    rows = {r["study"]: r for r in csv.DictReader(open(result["csv"]))}
    for name in (a, b):
        summary = json.loads((out / f"{name}-summary.json").read_text())
        assert not summary["resumed"]
        # one run: the wall time it printed is the one compare shows, to the last bit
        assert float(rows[name]["wall_s"]) == summary["wall_s"] == summary["elapsed_s"]
        assert f"{summary['wall_s']:.1f} s this run" in render(summary)
        assert rows[name]["workers"] == "1"
    md = open(result["markdown"]).read()
    assert "| workers |" in md and "Wall: the study's search time summed over its runs" in md
    # neither a sampled study nor an unpruned sweep has a bounding phase
    assert not any("bounding" in x for x in result["legend"])
    assert any(x.startswith(f"{b} (exhaustive, 1 worker)") for x in result["legend"])


def test_wall_time_adds_up_over_an_interrupted_and_a_resumed_run(tmp_path):
    cfg = config(tmp_path, trials=8, storage=None)
    name = default_study_name(cfg)
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, backend(tiny_space(), InterruptAfter(4)))
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/studies/{name}.db")
    first = study.user_attrs["wall_s"]  # stored on the way out of the interrupted run
    elapsed = [t.user_attrs["result"]["elapsed_s"] for t in study.trials if "result" in t.user_attrs]
    assert elapsed and first >= max(elapsed)
    summary = run_study(cfg, backend(tiny_space()))
    assert summary["resumed"] and summary["elapsed_s"] - summary["wall_s"] == pytest.approx(first, abs=1e-9)
    assert f"{summary['elapsed_s']:.1f} s over all runs" in render(summary)
    curve = load_curve(name, f"sqlite:///{tmp_path}/studies/{name}.db")  # what compare reads
    assert curve.wall_s == summary["elapsed_s"] and curve.workers == [1, 1] and curve.workers_text == "1"


def test_compare_reads_storages_without_changing_or_creating_files(two_studies, tmp_path):
    """An MLflow database given as --storage is refused untouched; a mistyped path creates nothing;
    a real storage is opened read-only (its file unchanged by a comparison)."""
    import hashlib
    import sqlite3

    tmp, _, a, b = two_studies
    out = str(tmp / "studies")
    mlflow_db = tmp_path / "mlflow.db"
    con = sqlite3.connect(mlflow_db)
    con.execute("create table experiments (a int)")
    con.commit()
    con.close()
    before = mlflow_db.read_bytes()
    with pytest.raises(PhazeError, match="another program's tables|not an Optuna storage"):
        compare([a, b], storage=f"sqlite:///{mlflow_db}", out_dir=str(tmp_path / "o1"), tracking_uri="off")
    assert mlflow_db.read_bytes() == before
    typo = tmp_path / "typo.db"
    with pytest.raises(PhazeError, match="no such file"):
        compare([a, b], storage=f"sqlite:///{typo}", out_dir=str(tmp_path / "o2"), tracking_uri="off")
    assert not typo.exists()
    db = tmp / "studies" / f"{a}.db"
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    compare([a, b], out_dir=out, tracking_uri="off", name="ro")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_compare_and_export_never_create_optunas_tables_in_another_database(tmp_path, capsys):
    """A database URL SQLite's own check does not cover (any SQLAlchemy URL: PostgreSQL, MySQL, or
    here SQLite through a named driver) holding another program's table: both read-only commands
    refuse it in one line and leave it as it was (Optuna's RDBStorage added its 13 tables)."""
    import sqlite3

    from phaze_opt import cli

    db = tmp_path / "theirs.db"
    con = sqlite3.connect(db)
    con.execute("create table orders (a int)")
    con.commit()
    con.close()
    url = f"sqlite+pysqlite:///{db}"
    with pytest.raises(PhazeError, match="not an Optuna storage") as info:
        compare(["x", "y"], storage=url, out_dir=str(tmp_path / "o"), tracking_uri="off")
    assert "\n" not in str(info.value)
    assert cli.main(["export", "x", "--storage", url, "--out", str(tmp_path / "x.csv")]) != 0
    assert "not an Optuna storage" in capsys.readouterr().err
    con = sqlite3.connect(db)
    assert {r[0] for r in con.execute("select name from sqlite_master where type='table'")} == {"orders"}
    con.close()


def test_the_table_says_how_many_times_as_long_each_study_took_and_flags_unequal_workers():
    fast = curve_from_trials("bound", "", [T(0, 60, 1.0), T(1, 100, 4.0)],
                             {"mode": "sampled", "sampler": "bound", "workers_per_run": [1], "wall_s": 5.0})
    slow = curve_from_trials("sweep", "", [T(0, 99.5, 10.0)],
                             {"mode": "exhaustive", "sampler": "exhaustive", "workers_per_run": [2], "wall_s": 12.0})
    never = curve_from_trials("tpe", "", [T(0, 80, 3.0), T(1, 87.5, 20.0)],
                              {"mode": "sampled", "sampler": "tpe", "workers_per_run": [1], "wall_s": 21.0})
    rows, target = table([fast, slow, never], 0.99)
    assert [r["time_vs_fastest"] for r in rows] == [1.0, 2.5, None]
    text = rows_markdown(rows, 0.99, target, "throughput")
    assert "| 2.50x |" in text and "| 1.00x |" in text
    line = verdict(rows, 0.99)
    assert line.startswith("bound reached 99% first: 4.0 s, 2 trials (1 worker)")
    assert "sweep took 2.50x as long (10.0 s, 1 trials, 2 workers)" in line
    assert "tpe never did: 87.50% of the best after 2 trials and 21.0 s (1 worker)" in line
    assert line.endswith("different worker counts, so their times are not like for like.")
    same = verdict(table([fast, never], 0.99)[0], 0.99)
    assert "not like for like" not in same
