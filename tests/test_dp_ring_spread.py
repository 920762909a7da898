"""A data-parallel ring that crosses nodes spreads its inter-node part over the NICs of its members
in each node (System.dp_ring_link): FSDP over whole DGX nodes runs at eight NICs, TP 8 at one.
The rule is checked by hand, the DPs' vectorised copy against the scalar one, and the dense DP
against brute force where only a larger degree of the same microbatch count gets the faster ring."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from phaze_opt.solve.placement.dp import optimal_dense_placement
from phaze_opt.solve.placement.kernel import ring_links
from phaze_opt.solve.placement.types import PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import Training
from test_placement_oracle import brute_force, chain_splits, make_costs, make_system


@pytest.mark.parametrize("t, dp, shard, members", [
    (1, 64, None, 8),   # FSDP over 8 whole nodes: every rank of a node is in the ring
    (8, 8, None, 1),    # TP 8: one member a node
    (2, 32, None, 4),   # TP 2: four members a node
    (1, 12, None, 4),   # 12 ranks over nodes of 8: some node holds only 4 of a group
    (3, 8, None, 1),    # a stride that does not divide a node
    (1, 64, 8, 1),      # HSDP in groups of a node: the replicas' all-reduce has one member a node
    (1, 64, 16, 1),
    (1, 64, 2, 4),      # HSDP in pairs: 32 replicas, two ranks apart, four of them a node
])
def test_members_per_node_by_hand(t, dp, shard, members):
    assert int(load_system("dgx-a100").ring_members_per_node(t, dp, shard)) == members


def test_fsdp_over_whole_nodes_gathers_at_the_node_nics():
    """dgx-a100: 8 HDR NICs of 24 GB/s achieved a node. A ring of 64 FSDP ranks moves its
    inter-node bytes over all 8 (192 GB/s, the NCCL bus bandwidth quoted in system.py); TP 8 leaves
    one member a node, on one NIC; a MoE's ring beside its expert groups is not spread."""
    system = load_system("dgx-a100")
    nic = system.inter_node.bandwidth
    assert nic == pytest.approx(24e9)
    assert system.dp_ring_link(1, 1, 64).bandwidth == pytest.approx(8 * nic)
    assert system.dp_ring_link(8, 1, 8).bandwidth == pytest.approx(nic)
    assert system.dp_ring_link(1, 1, 64, spread=False).bandwidth == pytest.approx(nic)
    assert system.dp_ring_link(1, 1, 8) is system.intra_node  # one node: NVLink
    # never above the NVLink a ring's intra-node hops run on
    fat = make_system(accelerators=16, devices_per_node=8, intra=(100.0, 0.5), inter=(30.0, 2.0))
    assert fat.dp_ring_link(1, 1, 16).bandwidth == pytest.approx(100.0)


def test_vectorised_ring_links_match_the_system_rule():
    """kernel.ring_links (the DPs') gives System.dp_ring_link (the evaluator's) for every case."""
    system = make_system(accelerators=48, devices_per_node=4, intra=(100.0, 0.5), inter=(10.0, 2.0))
    cases = [(w, S, d, g) for w, S, d in itertools.product((1, 2, 3, 4, 8), (1, 2, 3), range(1, 13))
             for g in (None, 1, 2, 4) if g is None or d % g == 0]
    for spread in (True, False):
        for w, S, d, g in cases:
            links = ring_links(system, w, np.array([S]), np.array([d]), g, spread=spread)
            want = system.dp_ring_link(w, S, d, g, spread=spread)
            assert (links.bandwidth()[0], links.latency()[0]) == (want.bandwidth, want.latency), (w, S, d, g)


def test_dense_dp_tries_the_degree_whose_ring_spans_more_nics():
    """Batch 7 on nodes of 4: one microbatch each from d = 7 up, but d = 7 has a node holding a
    single rank of the ring (one NIC) while d = 8 fills two nodes (four NICs). With a costly
    gradient all-reduce the optimum is d = 8, which the DP finds only if it looks past the first
    degree of the microbatch count (kernel.ring_degrees); brute force over every d is the oracle."""
    costs = make_costs(1, fwd=[100.0, 100.0], bwd=[200.0, 200.0], params=[400, 400], acts=[1, 1], boundary=[1, 1])
    system = make_system(accelerators=16, devices_per_node=4, global_batch=7, intra=(100.0, 0.01), inter=(1.0, 0.01),
                         optimizer="sgd")
    problem = PlacementProblem((costs,), system, 1e9, 1e3, training=Training(mbs=1), seq_len=8,
                               model_flops_per_sequence=100.0)
    best, placement = brute_force(problem, chain_splits(2))
    result = optimal_dense_placement(problem)
    assert result.time_per_batch_s == pytest.approx(best, rel=1e-12)
    assert (placement.dp, result.dp) == (8, 8)
