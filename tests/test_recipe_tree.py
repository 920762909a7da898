"""The recipe tree (`phaze_opt/training.py`): one declaration per field, from which the CLI, the files'
parsing, the keys, the docs and the space axes are generated, and the sweep stays exact on any of
them."""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt import training as tree
from phaze_opt.errors import PhazeError
from phaze_opt.training import (AT_DEFAULT, FIELDS, OPTIONAL_FIELDS, EXPERT, OPTIMAL, Fixed, Layout, RecipeError,
                                Training, add_recipe_arguments, bound_obstacles, file_value, recipe_from_args,
                                recipe_from_mapping, recipe_reference)

ROOT = Path(__file__).resolve().parents[1]
# Where a field's name may appear: its declaration and the modules that price it (the layer-graph tools
# among them, which take the attention kernel as a graph's parameter, as the truth measured it).
PRICING = ("phaze_opt/training.py", "phaze_opt/workload/", "phaze_opt/hardware/", "phaze_opt/design/",
           "phaze_opt/solve/", "phaze_opt/system.py", "phaze_opt/presets/", "phaze_opt/commands/workload.py",
           "phaze_opt/validation/layers.py")


def _other(k):
    """A valid value of field `k` other than its default (the second a space might list)."""
    if k.kind == "bool":
        return True if k.default in (None, False) else False
    if k.kind == "choice":
        return next(c for c in k.choices if c != k.default)
    if k.kind == "choices":
        return (k.choices[1],)
    if k.kind == "int":
        return 2
    if k.kind == "float":
        return 1.5
    raise AssertionError(k.kind)


def test_docs_recipe_md_is_the_declaration_rendered():
    assert (ROOT / "docs" / "recipe.md").read_text() == recipe_reference(), \
        "docs/recipe.md is stale: python -m phaze_opt.training > docs/recipe.md"


def _code_names(text: str, names: set[str]) -> list[tuple[int, str]]:
    """Field names used as code (an attribute, a keyword, a string key), not in comments or docstrings.
    A one-word name (zero, stack, attention) is also an everyday word of other nouns (a model's
    attention, a call stack), so it counts only as a recipe's attribute or as a string key."""
    out = []
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]
    for i, t in enumerate(toks):
        if t.type == tokenize.NAME and t.string in names:
            owner = toks[i - 2].string if i >= 2 and toks[i - 1].string == "." else ""
            if "_" in t.string or owner in ("training", "recipe"):
                out.append((t.start[0], t.string))
        elif t.type == tokenize.STRING and re.fullmatch(r"[rbfu]*(['\"])(\w+)\1", t.string, re.I):
            word = re.fullmatch(r"[rbfu]*(['\"])(\w+)\1", t.string, re.I).group(2)
            if word in names:
                out.append((t.start[0], word))
    return out


def test_no_module_outside_the_tree_and_its_pricing_names_a_recipe_field():
    """A new field touches its declaration and the code that prices it, nothing else: the CLI, suites,
    spaces, keys, reports and docs take every field from the declaration. (The microbatch, recompute
    and the placement are the study's own axes and words, so they are not counted.)"""
    names = {n for n in FIELDS if n not in ("mbs", "recompute", "placement")}
    found = {}
    for path in sorted((ROOT / "phaze_opt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(PRICING):
            continue
        uses = _code_names(path.read_text(), names)
        if uses:
            found[rel] = uses
    assert not found, found


def test_the_scan_finds_a_field_used_as_code():  # the test above can fail
    text = 'x = training.tp_comm_overlap\ny = row["zero"]\n# zero in a comment\n"""zero in a docstring"""\n'
    assert _code_names(text, {"tp_comm_overlap", "zero"}) == [(1, "tp_comm_overlap"), (2, "zero")]


@pytest.mark.parametrize("name", [n for n in FIELDS if n not in ("mbs",)])
def test_every_field_is_a_flag_that_reaches_the_recipe(name):
    k = FIELDS[name]
    parser = argparse.ArgumentParser()
    add_recipe_arguments(parser)
    value = "tp=2,pp=2,dp=2" if k.kind == "placement" else _other(k)
    if k.kind == "bool":
        argv = [k.flag] if value else ["--no-" + k.flag[2:]]
    elif k.kind == "choices":
        argv = [k.flag, *value]
    else:
        argv = [k.flag, str(value)]
    base = {"recompute": "selective"} if name in ("recompute_modules", "recompute_ops") else {}
    base.update({"recompute": "full"} if name == "recompute_every" else {})
    base.update({"precision": "fp8"} if name in ("fp8_param_gather", "fp8_scaling", "fp8_weight_recast") else {})
    base.update({"zero": 3} if name in ("reshard_after_forward", "shard_group") else {})
    base.update({"precision": "fp8", "zero": 3} if name == "fp8_all_gather" else {})
    args = parser.parse_args(argv + [f"--{f.replace('_', '-')}={v}" for f, v in base.items()])
    recipe = recipe_from_args(args)
    expected = Fixed(Layout(2, 2, 2)) if k.kind == "placement" else value
    assert getattr(recipe, name) == expected
    assert recipe.recipe()[name] == tree.plain(expected)  # a non-default value is in the key
    assert name not in Training().recipe() or k.listed == "always"  # a default one is not, but the first fields


def test_a_broken_flag_names_the_flag():
    parser = argparse.ArgumentParser()
    add_recipe_arguments(parser)
    with pytest.raises(PhazeError, match=r"^--fp8-param-gather: needs precision fp8 or mxfp8"):
        recipe_from_args(parser.parse_args(["--fp8-param-gather"]))


@pytest.mark.parametrize("name", OPTIONAL_FIELDS)
def test_every_field_is_a_space_axis(name):
    from phaze_opt.design.space import space_from_mapping

    k = FIELDS[name]
    values = [k.default if k.kind != "choices" else None, list(_other(k)) if k.kind == "choices" else _other(k)]
    params = {"num_tc": [4], "num_vc": [8], "tc_x": [128], "tc_y": [128], "glb_mib": [32], "hbm_gib": [80],
              "mbs": [1], "recompute": ["selective"], name: values}
    space = space_from_mapping({"name": "axis", "params": params, "tied": {"vc_width": "tc_x"},
                                "fixed": {"clock_ghz": 1.05}, "hbm_bw_gbps": {80: 2048},
                                "area": {"budget": "tpuv4", "min_fraction": 0.0}}, "axis.yaml")
    points = tree.recipe_points(space.params)
    assert len(points) == 2
    recipes = {Training.from_point(p) for p in points if not tree.recipe_problem(p)}
    assert {getattr(r, name) for r in recipes} <= {k.default, _other(k)} and len(recipes) >= 1
    # the sweep's bounds hold for the field's values, or the space says why they do not
    assert bool(bound_obstacles(space.params)) == (k.bound == AT_DEFAULT)


def test_a_space_value_of_the_wrong_type_is_one_line_naming_the_axis():
    from phaze_opt.design.space import space_from_mapping

    params = {"num_tc": [4], "num_vc": [8], "tc_x": [128], "tc_y": [128], "glb_mib": [32], "hbm_gib": [80],
              "mbs": [1], "recompute": ["none"], "tp_comm_overlap": ["on"]}
    with pytest.raises(PhazeError, match=r"params.tp_comm_overlap'.*true or false") as info:
        space_from_mapping({"name": "bad", "params": params, "tied": {"vc_width": "tc_x"},
                            "fixed": {"clock_ghz": 1.05}, "hbm_bw_gbps": {80: 2048},
                            "area": {"budget": "tpuv4", "min_fraction": 0.0}}, "bad.yaml")
    assert "\n" not in str(info.value)


def test_rules_across_fields_name_the_field_they_refuse():
    from phaze_opt.workload.models import load_model

    cases = [({"fp8_param_gather": True}, "fp8_param_gather"),
             ({"recompute_modules": ["layernorm"]}, "recompute_modules"),
             ({"moe_a2a_overlap": True, "recompute": "full"}, "moe_a2a_overlap")]
    for given, field in cases:
        with pytest.raises(RecipeError) as info:
            Training(**given)
        assert info.value.field == field and "\n" not in str(info.value)
    # at a published run's layout, a setting that cannot act there is refused (`check_for`); an
    # evaluation at that layout runs it as the no-op it is
    model = load_model("gpt2-xl")
    layout_cases = [({"cp_comm": "all_gather", "placement": "tp=1,pp=1,dp=8"}, "cp_comm"),
                    ({"virtual_stages": 2, "placement": "tp=1,pp=1,dp=8"}, "virtual_stages"),
                    ({"sequence_parallel": True, "placement": "tp=1,pp=2,dp=4"}, "sequence_parallel"),
                    ({"expert_weights": "activation"}, "expert_weights")]
    for given, field in layout_cases:
        with pytest.raises(RecipeError) as info:
            tree.check_for(Training(**given), model, 64)
        assert info.value.field == field and "\n" not in str(info.value)
    tree.check_for(Training(cp_comm="all_gather"), model, 64)  # the DP picks a layout where it acts


def test_placement_is_an_option_not_a_string():
    assert Training().placement == OPTIMAL and Training(placement="expert").placement == EXPERT
    fixed = Training(placement="tp=8,pp=4,dp=2,ep=2")
    assert fixed.placement == Fixed(Layout(8, 4, 2, ep=2)) and fixed.recipe()["placement"] == "tp=8,pp=4,dp=2,ep=2"
    assert Training(placement=Layout(8, 4, 2, ep=2)) == fixed and fixed.with_placement("optimal").placement == OPTIMAL


def test_a_recipe_is_a_tree_with_flat_access_and_replace():
    import dataclasses

    t = Training(2, "selective", zero=1, stack="megatron-te", recompute_modules=["layernorm", "core_attn"])
    assert t.memory.zero == t.zero == 1 and t.kernels.stack == "megatron-te"
    assert t.recompute_modules == ("core_attn", "layernorm")  # declaration order, each once
    u = dataclasses.replace(t, zero=3)
    assert u.zero == u.memory.zero == 3 and u.stack == "megatron-te" and u != t and hash(u) != hash(t)
    assert Training(**{k: v for k, v in t.values().items()}) == t
    with pytest.raises(RecipeError, match="is not a recipe field"):
        Training(zer0=1)


def test_a_suite_row_names_any_field_and_a_suite_may_set_a_default_for_every_row():
    row = {"virtual_stages": 2, "tp_comm_overlap": True, "sequence_parallel": True, "recompute": "full"}
    t = recipe_from_mapping(row, mbs=1, placement=Layout(2, 2, 2))
    assert t.tp_comm_overlap and t.virtual_stages == 2 and t.recompute == "full"
    with pytest.raises(RecipeError) as info:
        recipe_from_mapping({"tp_comm_overlap": "yes"}, mbs=1)
    assert info.value.field == "tp_comm_overlap"
    assert file_value("zero", 2) == 2
    with pytest.raises(RecipeError):
        file_value("zero", True)


def test_a_new_field_needs_only_its_declaration(tmp_path, monkeypatch):
    """A scratch copy of the tree with one more field: it is a flag, a key when set and absent when
    not, a file value, a space axis and a line of the reference, with nothing else edited."""
    source = (ROOT / "phaze_opt" / "training.py").read_text()
    anchor = "class Overlap(_Config):\n"
    assert anchor in source
    head, tail = source.split(anchor, 1)
    doc_end = tail.index('"""', tail.index('"""') + 3) + 3
    added = ('\n    scratch_overlap: bool = knob(False, "a scratch switch", says="scratch on")\n')
    scratch = head + anchor + tail[:doc_end] + added + tail[doc_end:]
    pkg = tmp_path / "scratchpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from phaze_opt.errors import PhazeError  # noqa: F401\n")
    (pkg / "training.py").write_text(scratch)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("scratchpkg.training", pkg / "training.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scratchpkg.training", module)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser()
    module.add_recipe_arguments(parser)
    recipe = module.recipe_from_args(parser.parse_args(["--scratch-overlap"]))
    assert recipe.scratch_overlap and recipe.overlap.scratch_overlap
    assert recipe.recipe()["scratch_overlap"] is True and "scratch_overlap" not in module.Training().recipe()
    assert "scratch_overlap" in module.OPTIONAL_FIELDS and module.file_value("scratch_overlap", True) is True
    assert "| `scratch_overlap` |" in module.recipe_reference()
    assert module.describe(recipe.recipe()) == ["scratch on"]
    # a key that existed before the field is unchanged by it
    assert module.Training(2, "full", zero=1).recipe() == Training(2, "full", zero=1).recipe()


# -- the sweep stays exact whatever recipe axes a space samples -----------------------------------------

TINY = {"num_tc": [4, 16], "num_vc": [8], "tc_x": [128], "tc_y": [128], "glb_mib": [32], "hbm_gib": [32, 80],
        "mbs": [1], "recompute": ["none", "full"]}


@st.composite
def recipe_axes(draw):
    """Two recipe fields drawn from the whole declaration, each with its default and another value."""
    names = draw(st.lists(st.sampled_from([n for n in OPTIONAL_FIELDS if n != "recompute_modules"]),
                          min_size=1, max_size=2, unique=True))
    return {n: [FIELDS[n].default, _other(FIELDS[n])] for n in names}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(recipe_axes())
def test_the_sweep_finds_the_brute_force_optimum_on_random_recipe_axes(tmp_path_factory, axes):
    import yaml

    from phaze_opt.search.config import StudyConfig
    from phaze_opt.search.runner import run_study

    tmp = tmp_path_factory.mktemp("axes")
    params = {**TINY, **{k: [tree.plain(v) for v in vs] for k, vs in axes.items()}}
    (tmp / "drawn.yaml").write_text(yaml.safe_dump(
        {"name": "drawn", "params": params, "tied": {"vc_width": "tc_x"}, "fixed": {"clock_ghz": 1.05},
         "hbm_bw_gbps": {32: 1200, 80: 2048}, "area": {"budget": "tpuv4", "min_fraction": 0.05,
                                                          "floor_exempt_if_one": ["num_tc", "num_vc"]}}))
    base = dict(models=("gpt2-xl",), space=str(tmp / "drawn.yaml"), hysteresis="off",
                tracking_uri="off", output_dir=str(tmp), progress=False)
    brute = run_study(StudyConfig(**base, strategy="grid"))  # every point evaluated
    swept = run_study(StudyConfig(**base, strategy="auto"))  # bounds where they hold, else evaluation
    assert swept["best"]["score"] == pytest.approx(brute["best"]["score"], rel=1e-12)
    uncovered = bound_obstacles(params)
    ex = swept["exhaustive"]
    if uncovered:  # a field the bounds do not cover: nothing was settled by a bound
        assert ex.get("evaluated_by_bound", 0) == 0
