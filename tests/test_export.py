"""`phaze-opt export` and `phaze_opt.results`: one row per trial, and the files read back as the same table."""

from __future__ import annotations

import math

import optuna
import pandas as pd
import pytest

import phaze_opt
from phaze_opt import cli
from phaze_opt.experiments.results import FORMATS, read
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import default_study_name
from test_study_fakes import backend, config, small_space


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = config(tmp, trials=30, sampler="random", models=("m-big",))
    run_study(cfg, backend(small_space()))
    return tmp, cfg, default_study_name(cfg)


def test_one_row_per_finished_trial_with_what_the_trial_holds(study):
    _, cfg, name = study
    frame = phaze_opt.results(name, storage=cfg.storage)
    trials = sorted(optuna.load_study(study_name=name, storage=cfg.storage).get_trials(), key=lambda t: t.number)
    assert list(frame["trial"]) == [t.number for t in trials]
    assert {"COMPLETE", "INFEASIBLE", "FAIL"} <= set(frame["state"])  # the fake space has all three
    for t, (_, row) in zip(trials, frame.iterrows()):
        result = t.user_attrs["result"]
        for key, value in t.user_attrs["point"].items():
            assert row[key] == value
        if row["state"] == "COMPLETE":
            assert row["feasible"] and row["throughput_seq_per_s"] == result["models"]["m-big"]["throughput"]
            assert row["area_mm2"] == result["area_mm2"] and row["tp"] == result["models"]["m-big"]["placement"]["tp"]
            assert pd.isna(row["reason"])
        else:
            assert not row["feasible"]
            assert row["reason"] == (result.get("reason") or result.get("error"))
    units = [c for c in frame.columns if c.endswith(("_seq_per_s", "_per_s", "_s", "_mm2", "_j"))]
    assert {"throughput_seq_per_s", "tokens_per_s", "time_per_batch_s", "area_mm2", "ilp_s", "trial_s"} <= set(units)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_round_trips(study, fmt, capsys):
    tmp, cfg, name = study
    out = tmp / f"trials.{fmt}"
    assert cli.main(["export", name, "--storage", cfg.storage, "--format", fmt, "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    expected = phaze_opt.results(name, storage=cfg.storage)
    back = read(out, fmt)
    assert list(back.columns) == list(expected.columns)
    assert len(back) == len(expected)
    for col in expected.columns:
        for a, b in zip(expected[col], back[col]):
            if isinstance(a, float) and math.isnan(a) or a is None or a is pd.NA or a is pd.NaT:
                assert pd.isna(b), (col, a, b)
            elif isinstance(a, pd.Timestamp):
                assert abs((pd.Timestamp(b).tz_localize(None) if pd.Timestamp(b).tzinfo else pd.Timestamp(b)) - a) \
                    < pd.Timedelta(milliseconds=1), col
            elif isinstance(a, float):
                assert b == pytest.approx(a, rel=1e-12), col
            else:
                assert b == a or str(b) == str(a), (col, a, b)


def test_a_study_is_found_by_its_db_file_and_default_output(study, monkeypatch, capsys):
    tmp, cfg, name = study
    db = cfg.storage[len("sqlite:///"):]
    monkeypatch.chdir(tmp)
    assert cli.main(["export", db, "--format", "json", "--json"]) == 0
    assert (tmp / "studies" / f"{name}-trials.json").is_file()


@pytest.mark.parametrize("argv, words", [
    (["export", "no-such-study"], ["unknown study 'no-such-study'"]),
    (["export", "x", "--format", "xlsx"], ["--format xlsx: choose one of csv, parquet, json"]),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_the_storage_opens_with_optunas_public_api_as_optuna_dashboard_reads_it(study):
    _, cfg, name = study
    storage = optuna.storages.RDBStorage(cfg.storage)
    summaries = optuna.get_all_study_summaries(storage)
    assert [s.study_name for s in summaries] == [name]
    frame = optuna.load_study(study_name=name, storage=storage).trials_dataframe()
    assert "user_attrs_design.num_tc" in frame.columns and frame["user_attrs_design.num_tc"].notna().all()


def test_export_and_compare_read_a_study_on_a_read_only_folder(tmp_path):
    """A WAL database opened read-only needs its -shm file, which SQLite cannot create in a read-only
    folder: export and compare said "not an Optuna database" of a sound study on read-only media."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="phaze-ro-"))  # outside the 0700 pytest folder, for `nobody`
    try:
        for name in ("first", "second"):
            cfg = config(root, trials=4, sampler="random", models=("m-big",), tracking_uri="off", study_name=name)
            run_study(cfg, backend(small_space()))
        import sqlite3

        made = next(Path(cfg.output_dir).glob("*.db"))
        con = sqlite3.connect(made)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        db = root / "media" / made.name  # the database alone, still in WAL mode, as copied to read-only media
        db.parent.mkdir()
        shutil.copyfile(made, db)
        out = root / "out"
        out.mkdir()
        for d in (root, out):
            d.chmod(0o777)
        os.chmod(db.parent, 0o555)
        os.chmod(db, 0o444)
        # root writes through permissions: the folder is then mounted read-only in a mount namespace of its own
        as_user = (["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" '
                    '&& exec "$@"', str(db.parent)] if os.geteuid() == 0 else [])
        repo = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": repo, "MLFLOW_DISABLE_TELEMETRY": "true", "HOME": str(out)}
        url = f"sqlite:///{db}"
        for args in (["export", "first", "--storage", url, "--out", str(out / "t.csv")],
                     ["compare", "first", "second", "--storage", url, "--tracking-uri", "off", "--output-dir", str(out)]):
            proc = subprocess.run([*as_user, sys.executable, "-m", "phaze_opt", *args], env=env, cwd=str(out),
                                  capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, (args[0], proc.stderr[-2000:])
        assert len(pd.read_csv(out / "t.csv")) == 4
        assert sorted(p.name for p in db.parent.iterdir()) == [db.name]  # nothing written beside it
    finally:
        os.chmod(root, 0o755)
        for p in root.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)
