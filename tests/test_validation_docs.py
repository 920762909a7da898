"""docs/validation.md is generated: the prose, the shipped suites and the last run, put together.

It fails when the committed page is not what the generator renders, when the committed run no longer
covers the shipped suites (a suite gained a row or a new suite came without a new run), when a saved
run does not render as the live one did, and when a target's MAPE is not the mean over its rows.
"""

from __future__ import annotations

import difflib
import json

import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.jsonable import jsonable
from phaze_opt.validation import docs
from phaze_opt.validation.report import suite_sections, summary_table
from phaze_opt.validation.runner import RowResult, SuiteResult

PAGE = docs.DOCS / "validation.md"


def test_docs_validation_md_is_the_generators_output():
    committed = PAGE.read_text() if PAGE.exists() else ""
    rendered = docs.render()
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                             "docs/validation.md", "generated now", n=1))[:40])
    assert committed == rendered, f"docs/validation.md is out of date; regenerate it with `{docs.REGENERATE}`\n{diff}"


def test_the_committed_run_covers_every_shipped_suite_row_for_row():
    _, runs = docs.load_results()
    ran = {s.name: [r.label for r in s.rows] for s in runs}
    shipped = {suite.name: suite for suite in docs.shipped_suites()}
    assert sorted(ran) == sorted(shipped), "run `phaze-opt validate --out docs`, then regenerate the page"
    for name, suite in shipped.items():
        assert ran[name] == [row.source.row for row in suite.rows], name


def test_the_page_lists_every_suite_with_its_rows_and_sources():
    page = PAGE.read_text()
    suites = docs.shipped_suites()
    assert len(suites) >= 10
    for suite in suites:
        name = suite.name
        assert f"| `{name}` | {suite.description} |" in page
        line = next(x for x in page.splitlines() if x.startswith(f"| `{name}` |"))
        assert line.split(" | ")[3] == str(len(suite.rows))
        for citation in suite.papers.values():
            assert citation in page


def _row(i, error, fitted, **config):
    return RowResult(suite="s", index=i, label=f"row {i}", config={"model": "m", "tp": 1, "pp": 1, "dp": 8, "gpus": 8,
                     "batch": 64, "mbs": 1, "recompute": "selective", **config},
                     published=2.0, predicted=2.0 * (1 + error), fitted=fitted,
                     source={"paper": "p", "table": "t", "row": f"row {i}"})


def _suite(rows, name="s"):
    return SuiteResult(name=name, description="a suite", metric="iteration_time_s", arch="h100-sxm",
                       system="dgx-h100", rows=tuple(rows), efficiency={"intra_node_bandwidth": 0.8,
                       "inter_node_bandwidth": 0.9, "microbatch_overhead_s": 0.001},
                       arch_efficiency={"tc_fraction": 0.7}, flops_formula="megatron-core")


def test_a_saved_run_renders_as_the_live_one():
    layer = RowResult(suite="l", index=0, label="gpt tp 1", config={"model": "gpt", "tp": 1, "mbs": 1,
                      "attention": "flash"}, published=0.01, predicted=0.011, fitted=True, schedule_gap=0.002)
    live = [_suite([_row(0, 0.1, False, recompute_modules=("core_attn", "mlp"), ep=8),
                    _row(1, -0.05, True, cp=2),
                    RowResult(suite="s", index=2, label="r", config=_row(2, 0, False).config, published=1.0,
                              predicted=None, fitted=False, feasible=False, reason="over HBM")]),
            SuiteResult(name="l", description="blocks", metric="layer_seconds", arch="h100-sxm", system=None,
                        rows=(layer,))]
    saved = [SuiteResult.from_json(json.loads(json.dumps(jsonable(s.to_json())))) for s in live]
    assert suite_sections(saved) == suite_sections(live)
    assert summary_table(saved) == summary_table(live)
    assert [jsonable(s.to_json()) for s in saved] == [jsonable(s.to_json()) for s in live]


def test_every_committed_suite_survives_the_round_trip():
    data, runs = docs.load_results()
    assert [jsonable(s.to_json()) for s in runs] == data["suites"]


def test_a_targets_mape_is_the_mean_over_its_rows_and_its_verdict_follows_the_bound():
    runs = [_suite([_row(0, 0.10, False), _row(1, 0.30, True), _row(2, -0.20, False, ep=4), _row(3, 0.04, True, cp=2)]),
            _suite([_row(0, 0.06, False), _row(1, 0.5, True, ep=2)], name="t")]
    held = docs.Target("held-out rows", ("s",), 0.16)
    dense = docs.Target("dense", ("s", "t"), 0.10, "all", docs._dense)
    moe_cp = docs.Target("moe or cp", ("s",), 0.10, "all", docs._moe_or_cp)
    assert [r.index for r in docs.target_rows(dense, runs)] == [0, 1, 3, 0]
    table = docs.targets_table(runs, (held, dense, moe_cp))
    assert table[2] == "| s | held-out rows (2) | 15.0% | <= 16%: met |"  # (0.10 + 0.20) / 2
    assert table[3] == "| s, t | dense (4) | 12.5% | <= 10%: missed |"  # (0.10 + 0.30 + 0.04 + 0.06) / 4
    assert table[4] == "| s | moe or cp (2) | 12.0% | <= 10%: missed |"  # (0.20 + 0.04) / 2
    tighter = docs.targets_table(runs, (docs.Target("held-out rows", ("s",), 0.14),))
    assert tighter[2].endswith("<= 14%: missed |")


def test_a_target_naming_a_suite_the_run_lacks_is_one_line():
    with pytest.raises(PhazeError, match="no run of nope") as err:
        docs.targets_table([_suite([_row(0, 0.1, False)])], (docs.Target("rows", ("nope",), 0.1),))
    assert "\n" not in str(err.value)


def test_a_template_without_its_marker_is_one_line_naming_it(tmp_path):
    template = tmp_path / "validation.md"
    template.write_text("# Validation\n\n<!-- suites -->\n<!-- figures -->\n")
    with pytest.raises(PhazeError, match=r"validation.md: needs the line <!-- report --> exactly once"):
        docs.render(template)


def test_a_results_file_that_is_not_a_run_is_one_line(tmp_path):
    bad = tmp_path / "validation.json"
    bad.write_text('{"suites": [{"suite": "x"}]}')
    with pytest.raises(PhazeError, match="not a `phaze-opt validate` validation.json") as err:
        docs.load_results(bad)
    assert "\n" not in str(err.value)


def test_a_users_own_suites_stay_off_the_page(tmp_path, monkeypatch):
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "mine.yaml").write_text("suite: mine\n")
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(tmp_path))
    assert "mine" not in [s.name for s in docs.shipped_suites()]
    assert docs.render() == PAGE.read_text()
