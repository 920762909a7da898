"""The search-space <-> Optuna parameter encoding."""

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.search.encoding import CATEGORICAL, FIXED, INDEX, LOG2, SpaceCodec, coding_for

pow2_lists = st.integers(0, 10).flatmap(lambda lo: st.integers(lo, 12).map(lambda hi: [2**e for e in range(lo, hi + 1)]))
sorted_ints = st.lists(st.integers(-1000, 1000), min_size=1, max_size=8, unique=True).map(sorted)
floats = st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=6, unique=True).map(
    lambda xs: sorted(xs, reverse=True))
unordered = st.lists(st.integers(1, 50), min_size=3, max_size=6, unique=True)
labels = st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=5, unique=True)
bools = st.sampled_from([[False, True], [True, False], [True], [False]])
choice_lists = st.one_of(pow2_lists, sorted_ints, floats, unordered, labels, bools)
spaces = st.dictionaries(st.sampled_from(["num_tc", "tc_x", "glb_mib", "hbm_gib", "mbs", "recompute", "x"]),
                         choice_lists, min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(spaces, st.data())
def test_every_point_round_trips_through_optuna(params, data):
    codec = SpaceCodec(params)
    point = {name: data.draw(st.sampled_from(choices)) for name, choices in params.items()}
    encoded = codec.encode(point)
    assert codec.decode(encoded) == point
    # Each encoded value lies in its Optuna distribution, and a trial fixed to it suggests the point.
    dists = codec.distributions()
    assert set(dists) == set(encoded)
    for key, value in encoded.items():
        assert dists[key]._contains(dists[key].to_internal_repr(value))
    suggested = codec.suggest(optuna.trial.FixedTrial(encoded))
    assert suggested == point
    assert all(type(suggested[k]) is type(point[k]) for k in point)


@settings(max_examples=60, deadline=None)
@given(spaces, st.integers(0, 2**31 - 1))
def test_sampled_params_always_decode_to_choices(params, seed):
    codec = SpaceCodec(params)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    trial = study.ask()
    point = codec.suggest(trial)
    for name, choices in params.items():
        assert point[name] in choices


def test_kinds_keep_order_where_the_space_has_one():
    assert coding_for("num_tc", [4, 1, 2]).kind == CATEGORICAL  # no order to keep
    c = coding_for("num_tc", [1, 2, 4, 8, 16])
    assert (c.kind, c.key, c.first_exponent) == (LOG2, "log2_num_tc", 0)
    assert c.encode(16) == 4 and c.decode(4) == 16
    c = coding_for("glb_mib", [2, 4, 8])
    assert (c.kind, c.encode(2), c.encode(8)) == (LOG2, 1, 3)
    assert coding_for("hbm_gib", [32, 64, 80]).kind == INDEX
    assert coding_for("hbm_gib", [32, 64, 80]).encode(80) == 2
    assert coding_for("mbs", [1, 2, 8]).kind == INDEX  # powers of two with a gap are ordered by index
    assert coding_for("recompute", [False, True]).kind == CATEGORICAL
    assert coding_for("mbs", [4]).kind == FIXED


def test_bool_and_int_choices_are_not_confused():
    c = coding_for("flag", [True, 1, "1"])
    assert c.kind == CATEGORICAL
    assert c.encode(1) == 1 and c.encode(True) is True and c.encode("1") == "1"
    with pytest.raises(ValueError):
        coding_for("mbs", [1, 2]).encode(True)


def test_value_outside_the_choices_is_refused():
    codec = SpaceCodec({"mbs": [1, 2, 4], "recompute": [False, True]})
    with pytest.raises(ValueError, match="not one of its choices"):
        codec.encode({"mbs": 3, "recompute": False})
    with pytest.raises(ValueError, match="lacks"):
        codec.encode({"mbs": 1})
    assert not codec.contains({"mbs": 3, "recompute": False})


@pytest.mark.parametrize("params, message", [
    ({}, "no parameters"),
    ({"mbs": []}, "'mbs' has no choices"),
    ({"mbs": [1, 2, 1]}, "repeats a choice"),
    ({"x": [[1], [2], 3]}, "not a number, string, boolean or list of names"),
])
def test_bad_spaces_are_one_line_errors(params, message):
    with pytest.raises(PhazeError, match=message) as info:
        SpaceCodec(params)
    assert "\n" not in str(info.value)
