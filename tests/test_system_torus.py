"""The torus network (phaze_opt/torus.py and System's torus branch) against a brute-force mapping of
groups onto the torus, ring facts, and the two-level model it must not contradict.

- `Torus.span` against brute force over the rank layout's coordinates (every group of the layout);
- a one-dimensional torus is a (bidirectional) ring; an open one a unidirectional ring;
- a group that fills more closed dimensions never gets less bandwidth; no group's all-reduce beats
  the bandwidth of the links it uses; closing a line never slows it;
- the all-to-all never beats its links; pairwise exchange for two members;
- System: tpuv4-pod's numbers, TP never slower than the two-level model of the same slice, pipeline
  hops and data-parallel rings exactly the two-level rules (what the placement DP vectorises), and
  the placement DP still equal to brute force on a torus system;
- one-line errors for bad torus blocks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.dp import optimal_dense_placement
from phaze_opt.solve.placement.evaluate import evaluate_placement, ring_allreduce_s
from phaze_opt.solve.placement.expert import optimal_placement
from phaze_opt.solve.placement.types import PlacementProblem
from phaze_opt.system import Link, load_system, system_from_dict
from phaze_opt.torus import Torus, alltoall_seconds, ring_equivalent
from phaze_opt.training import Training
from test_placement_dp import SETTINGS, assert_matches_oracle, assert_recipe_matches_oracle, problems, recipe_problems
from test_placement_oracle import chain_splits, make_costs, make_system
from test_expert_parallel import brute as moe_brute, moe_problem

B, ALPHA = 50e9, 1e-6
DIMS = st.lists(st.integers(1, 9), min_size=1, max_size=3)


def _coords(rank: int, dims) -> tuple[int, ...]:
    out = []
    for n in dims:
        out.append(rank % n)
        rank //= n
    return tuple(out)


def brute_span(dims, wrap: bool, g: int, stride: int):
    """(dim, members, spacing, closed) per dimension the group crosses, from coordinates: the group
    maps when the slice splits into groups of the layout (rank = a + stride (j + g k), a < stride),
    every one of them the translate of group 0 by its first member without carry, and group 0 the
    product of one progression from 0 per dimension (as many members as g)."""
    if g == 1:
        return []  # no collective: nothing to map
    size = math.prod(dims)
    if size % (stride * g):
        return None
    first = [_coords(stride * j, dims) for j in range(g)]
    for base in range(size):
        if base % (stride * g) >= stride:
            continue  # not the first member of a group
        b = _coords(base, dims)
        for j in range(g):
            if _coords(base + stride * j, dims) != tuple(x + y for x, y in zip(b, first[j])):
                return None
    lines, count = [], 1
    for i, n in enumerate(dims):
        values = sorted({c[i] for c in first})
        if len(values) == 1:
            continue
        step = values[1]
        if values != list(range(0, step * len(values), step)):
            return None
        lines.append((i, len(values), step, wrap and len(values) * step == n and len(values) >= 3))
        count *= len(values)
    return lines if count == g else None


@settings(max_examples=400, **SETTINGS)
@given(DIMS, st.booleans(), st.integers(1, 40), st.integers(1, 40))
def test_span_matches_brute_force(dims, wrap, g, stride):
    got = Torus(tuple(dims), wrap).span(g, stride)
    want = brute_span(dims, wrap, g, stride)
    if got is None:
        assert want is None
    else:
        assert [(l.dim, l.members, l.spacing, l.closed) for l in got] == want


def test_span_of_the_layout_groups():
    t = Torus((8, 8, 16))
    assert [(l.dim, l.members, l.spacing, l.closed) for l in t.span(8, 1)] == [(0, 8, 1, True)]
    assert [(l.dim, l.members) for l in t.span(128, 1)] == [(0, 8), (1, 8), (2, 2)]
    assert [(l.dim, l.members, l.spacing) for l in t.span(4, 2)] == [(0, 4, 2)]  # CP of 4 at TP 2
    assert t.span(12, 1) is None and t.span(2048, 1) is None and t.span(2, 1024) is None


def test_a_group_that_does_not_map_rides_the_rank_order_path_inside_the_slice():
    s = load_system("tpuv4-2x3072")  # 12 x 16 x 16: TP 8 does not fill or tile dimension 0
    assert s.torus.span(8, 1) is None
    assert s.tp_link(8) == s.intra_node and s.tp_within_node(8)  # one unidirectional ring at one link
    assert s.cp_link(8, 4).bandwidth == pytest.approx(s.intra_node.bandwidth / 8)  # 8 groups share the path
    assert s.tp_link(4096) is s.inter_node and s.cp_link(1024, 4) is s.inter_node  # leaves the slice


@pytest.mark.parametrize("n", [3, 4, 7, 16])
def test_one_dimension_is_a_bidirectional_ring(n):
    system = _torus_system([n])
    nbytes = 3e8
    # two rings, one per direction, each all-reducing half the bytes (Patarasuk and Yuan 2009)
    expected = 2 * (n - 1) / n * (nbytes / 2) / B + 2 * (n - 1) * ALPHA
    link = system.tp_link(n)
    assert 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency == pytest.approx(expected)
    open_line = _torus_system([n], wraparound=False).tp_link(n)
    assert (open_line.bandwidth, open_line.latency) == pytest.approx((B, ALPHA))


def test_full_pod_all_reduce_matches_the_published_figure():
    bw, _ = ring_equivalent(Torus((16, 16, 16)).span(4096, 1), B, ALPHA)
    assert bw == pytest.approx(6 * B)  # six links, all busy
    published = 1.1e15 / 4096  # Google Cloud, TPU v4: "All-reduce bandwidth per Pod 1.1 PB/s"
    assert 0.85 < published / bw < 1.0


@settings(max_examples=300, **SETTINGS)
@given(st.lists(st.integers(3, 16), min_size=2, max_size=4))
def test_filling_more_closed_dimensions_never_lowers_bandwidth(dims):
    torus = Torus(tuple(dims))
    bandwidths = [ring_equivalent(torus.span(math.prod(dims[:k]), 1), B, ALPHA)[0] for k in range(1, len(dims) + 1)]
    assert all(a <= b * (1 + 1e-12) for a, b in zip(bandwidths, bandwidths[1:])), bandwidths


@st.composite
def mapped_groups(draw):
    dims = tuple(draw(DIMS))
    wrap = draw(st.booleans())
    size = math.prod(dims)
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    g, stride = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors))
    lines = Torus(dims, wrap).span(g, stride)
    return dims, wrap, g, stride, lines


@settings(max_examples=300, **SETTINGS)
@given(mapped_groups())
def test_no_collective_beats_its_links(case):
    dims, wrap, g, stride, lines = case
    if not lines:
        return
    # every chip must send 2 (g - 1) / g of the bytes (all-reduce) or (g - 1) / g (all-to-all), over
    # at most the links of its lines, each shared with the groups interleaved on it
    links = sum((2 if l.closed else 1) * B / l.spacing for l in lines)
    bw, lat = ring_equivalent(lines, B, ALPHA)
    assert bw <= links * (1 + 1e-12) and 0 < lat <= ALPHA
    assert alltoall_seconds(lines, 1e9, B, ALPHA) >= (g - 1) / g * 1e9 / links * (1 - 1e-12)


@settings(max_examples=200, **SETTINGS)
@given(mapped_groups())
def test_closing_the_lines_never_slows_a_collective(case):
    dims, _, g, stride, _ = case
    closed, open_ = Torus(dims, True).span(g, stride), Torus(dims, False).span(g, stride)
    if not closed:
        return
    assert ring_equivalent(closed, B, ALPHA)[0] >= ring_equivalent(open_, B, ALPHA)[0] * (1 - 1e-12)
    assert alltoall_seconds(closed, 1e9, B, ALPHA) <= alltoall_seconds(open_, 1e9, B, ALPHA) * (1 + 1e-12)


def test_all_to_all_of_two_is_a_pairwise_exchange_and_long_lines_are_bisection_bound():
    torus = Torus((16,))
    assert alltoall_seconds(torus.span(2, 1), 1e9, B, ALPHA) == pytest.approx(ALPHA + 0.5e9 / B)
    # 16 on a ring: half of each chip's bytes cross 2 cut links a direction: 16 x 1e9 / 4 / (2 B)
    assert alltoall_seconds(torus.span(16, 1), 1e9, B, ALPHA) == pytest.approx(16 * 1e9 / (8 * B))


def test_tpuv4_pod_preset():
    s = load_system("tpuv4-pod")
    assert (s.accelerators, s.devices_per_node, s.torus.dims, s.global_batch) == (1024, 1024, (8, 8, 16), 4096)
    assert s.intra_node.bandwidth == pytest.approx(0.9 * B)  # one ICI link, the published efficiency
    assert s.tp_link(8).bandwidth == pytest.approx(2 * s.intra_node.bandwidth)
    assert s.tp_link(12) is s.inter_node and not s.tp_within_node(12) and s.tp_within_node(8)
    assert s.summary()["torus"] == {"dims": [8, 8, 16], "wraparound": True}
    palm = load_system("tpuv4-2x3072")
    assert palm.accelerators == 2 * palm.devices_per_node == 6144
    assert palm.tp_link(12).bandwidth == pytest.approx(2 * palm.intra_node.bandwidth)
    # On default, a TP group that neither divides the 8-GPU node nor spans whole nodes (PaLM's 12)
    # runs at one NIC's share of the inter-node link; on the torus it is a ring over ICI links
    assert load_system("default").tp_link(12).bandwidth < palm.tp_link(12).bandwidth


@pytest.mark.parametrize("name", ["tpuv4-pod", "tpuv4-2x3072"])
def test_torus_keeps_the_two_level_rules_for_hops_and_rings_and_never_slows_tp(name):
    torus = load_system(name)
    nodes = replace(torus, torus=None)  # the same slice as a two-level node
    for t in range(1, 65):
        assert torus.tp_link(t).bandwidth >= nodes.tp_link(t).bandwidth
        for pp in (1, 2, 3, 4, 8):
            assert torus.pipeline_link(t, pp) == nodes.pipeline_link(t, pp)
            for dp in (1, 2, 16, 64):
                assert torus.dp_link(t, pp, dp) == nodes.dp_link(t, pp, dp)


@settings(max_examples=40, **SETTINGS)
@given(problems(), st.sampled_from([(1,), (2,), (2, 2), (4, 2), (2, 2, 2)]))
def test_placement_dp_equals_brute_force_on_a_torus(problem, dims):
    torus = Torus(dims)
    system = replace(problem.system, devices_per_node=torus.size, torus=torus)
    assert_matches_oracle(replace(problem, system=system), chain_splits(problem.n_layers))


TORI = st.sampled_from([(2,), (4,), (2, 2), (4, 2), (3, 3), (2, 2, 2)])


@settings(max_examples=60, **SETTINGS)
@given(recipe_problems(), TORI, st.booleans())
def test_placement_dp_with_torus_rings_equals_brute_force(problem, dims, wraparound):
    """Data-parallel rings priced as the torus gives them (`dp_ring_link`): a larger ring can span
    more torus lines and run faster, so neither DP may keep only the smallest d of a microbatch
    count; every recipe (the fast path without ZeRO, the general one with ZeRO, overlapped
    reduction, interleaving) checked."""
    torus = Torus(dims, wraparound)
    system = replace(problem.system, devices_per_node=torus.size, torus=torus)
    assert_recipe_matches_oracle(replace(problem, system=system), chain_splits(problem.n_layers))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), TORI, st.sampled_from([0, 1, 2]), st.booleans())
def test_expert_dp_with_torus_rings_equals_brute_force(seed, dims, zero, overlap):
    problem = moe_problem(seed, zero=zero, overlap_grad_reduce=overlap)
    torus = Torus(dims)
    problem = replace(problem, system=replace(problem.system, devices_per_node=torus.size, torus=torus))
    want, where = moe_brute(problem)
    got = optimal_placement(problem)
    assert got.feasible == math.isfinite(want), (want, where, got.reason)
    if got.feasible:
        assert got.time_per_batch_s == pytest.approx(want, rel=1e-9), where


def test_a_wider_ring_on_a_torus_can_be_faster_than_a_narrower_one():
    """Why the DPs try every d on a torus: some ring of more replicas, spanning more torus lines,
    finishes the same all-reduce sooner than a ring of fewer (under the two-level rule never)."""
    s = replace(load_system("tpuv4-pod"), torus=Torus((2, 2, 2)), accelerators=16)

    def ring_s(t, pp, dp, nbytes=1e9):
        link = s.dp_ring_link(t, pp, dp)
        return 2 * (dp - 1) * link.latency + 2 * (dp - 1) / dp * nbytes / link.bandwidth

    assert any(ring_s(1, 1, d2) < ring_s(1, 1, d1) for d1 in range(2, 9) for d2 in range(d1 + 1, 17)
               if s.dp_ring_link(1, 1, d2) != s.dp_link(1, 1, d2))


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_dps_take_the_wider_faster_ring(zero):
    """On a closed line of 4, a ring of 4 replicas all-reduces faster than one of 3 (which does
    not map onto the line and rides the rank order); with a global batch of 3 both run one
    microbatch, so only the ring tells them apart, and both DPs must find d = 4."""
    system = replace(make_system(accelerators=4, global_batch=3, intra=(100.0, 0.01), inter=(10.0, 0.5)),
                     devices_per_node=4, torus=Torus((4,)))
    four, three = system.dp_ring_link(1, 1, 4), system.dp_ring_link(1, 1, 3)
    assert ring_allreduce_s(1e2, 4, four.bandwidth, four.latency) < ring_allreduce_s(1e2, 3, three.bandwidth, three.latency)
    costs = make_costs(1, [1.0], [2.0], [50.0], [1.0], [0.0])
    problem = PlacementProblem(training=Training(mbs=1, zero=zero), costs=(costs,), system=system,
                               hbm_bytes=1e9, peak_flops=1.0)
    for solve in (optimal_dense_placement, optimal_placement):
        got = solve(problem)
        assert got.dp == 4, (solve.__name__, got.dp)
        assert got.time_per_batch_s == pytest.approx(evaluate_placement(problem, got.placement()).time_per_batch_s)


DROP = object()  # a field left out of the block


def _torus_system(dims, wraparound=True, **extra):
    return system_from_dict({"torus": {"dims": dims, "wraparound": wraparound,
                                       "link": {"bandwidth": B, "latency": ALPHA}},
                             "inter_node": {"bandwidth": 1e9, "latency": 1e-5}, **extra}, "t.yaml")


@pytest.mark.parametrize("block, extra, field, words", [
    ({"dims": [4, 0]}, {}, "torus.dims", "positive integers"),
    ({"dims": [2, 2, 2, 2, 2]}, {}, "torus.dims", "1 to 4"),
    ({"dims": [4], "shape": 1}, {}, "torus.shape", "unknown field"),
    ({"dims": DROP}, {}, "torus.dims", "missing required field"),
    ({"link": DROP}, {}, "torus.link", "missing required field"),
    ({"dims": [4], "link": {"bandwidth": "fast", "latency": ALPHA}}, {}, "torus.link.bandwidth", "unit"),
    ({"dims": [4], "link": {"bandwidth": 1e8, "latency": ALPHA}}, {}, "torus.link.bandwidth", "at least inter_node"),
    ({"dims": [4], "wraparound": "yes"}, {}, "torus.wraparound", "true or false"),
    ({"dims": [4]}, {"devices_per_node": 4}, "devices_per_node", "not allowed with torus"),
    ({"dims": [4]}, {"intra_node": {"bandwidth": B, "latency": 0}}, "intra_node", "not allowed with torus"),
])
def test_bad_torus_blocks_are_one_line_errors(block, extra, field, words):
    raw = {k: v for k, v in {"dims": [4], "link": {"bandwidth": B, "latency": ALPHA}, **block}.items() if v is not DROP}
    data = {"torus": raw, "inter_node": {"bandwidth": 1e9, "latency": 1e-5}, **extra}
    with pytest.raises(PhazeError) as err:
        system_from_dict(data, "t.yaml")
    message = str(err.value)
    assert "\n" not in message and field in message and words in message, message


def test_efficiency_scales_the_torus_link():
    s = _torus_system([8], efficiency={"intra_node_bandwidth": 0.5})
    assert s.intra_node == Link(B * 0.5, ALPHA)
    assert s.tp_link(8).bandwidth == pytest.approx(B)  # 2 directions x the achieved link


def test_dp_ring_link_is_hierarchical_on_a_torus_and_dp_link_elsewhere():
    palm = load_system("tpuv4-2x3072")  # 12 x 16 x 16 slices, TP 12: 256 replicas a slice, 2 slices
    ici, dcn = palm.intra_node.bandwidth, palm.inter_node.bandwidth
    inner = palm.dp_ring_link(12, 1, 256)
    assert inner.bandwidth == pytest.approx(4 * ici)  # two closed dimensions, both directions
    # reduce-scatter in the slice, all-reduce of the 1/256 shard across the 2 slices, all-gather back
    per_byte = 2 * 255 / 256 / (4 * ici) + 2 * (1 / 2) / 256 / dcn
    assert palm.dp_ring_link(12, 1, 512).bandwidth == pytest.approx(2 * 511 / 512 / per_byte)
    assert palm.dp_ring_link(12, 1, 512).bandwidth > 20 * palm.dp_link(12, 1, 512).bandwidth
    for name in ("default", "dgx-a100", "phaze"):
        s = load_system(name)
        for t, pp, dp in [(1, 1, 8), (8, 1, 64), (8, 4, 32), (2, 2, 2)]:
            assert s.dp_ring_link(t, pp, dp) == s.dp_link(t, pp, dp)


@settings(max_examples=200, **SETTINGS)
@given(st.sampled_from([(8, 8, 16), (12, 16, 16), (4, 4), (16,)]), st.integers(1, 16), st.integers(1, 8),
       st.integers(1, 64))
def test_a_dp_ring_on_whole_torus_lines_is_never_slower_than_the_two_level_rule(dims, t, pp, dp):
    s = _torus_system(list(dims), accelerators=4 * math.prod(dims))
    size, stride = s.torus.size, pp * t
    inner = dp if stride * dp <= size else size // stride
    lines = s.torus.span(inner, stride) if inner >= 1 and dp % inner == 0 and stride * dp <= s.accelerators else None
    if lines is None or any(line.spacing > 1 for line in lines):
        return  # replicas spaced out share their links with the interleaved groups: slower, rightly
    assert s.dp_ring_link(t, pp, dp).bandwidth >= s.dp_link(t, pp, dp).bandwidth * (1 - 1e-12)
