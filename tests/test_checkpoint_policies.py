"""Activation-checkpointing policies of PyTorch-native stacks (torchtitan): full checkpointing of
every n-th block (`Training.recompute_every`) and the op-level selective policy
(`Training.recompute_ops`). The recipe's checks; the op policy's kept bytes on a traced block
against a real eager run of the same block under torchtitan's policy (an oracle that shares no code
with the trace's mapper); memory between none and full and recompute time ordered, through the
evaluator; the every-n-th rule against a count of each stage's blocks. The exact DPs' agreement with
the evaluator under both policies: `recipe_problems` in test_placement_dp.py draws them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from phaze_opt.design.evaluate import op_policy_tags
from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import LayerCosts, Placement, PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import Training
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.layers import build_layer, example_inputs
from phaze_opt.workload.models import load_model, parse_model
from phaze_opt.workload.stack import recipe_graph
from phaze_opt.workload.trace import trace_layer_details

from test_qkv_projection import TINY

SEQ = 256


# --- the recipe ----------------------------------------------------------------------------------

def test_the_policies_are_checked_in_one_line():
    with pytest.raises(PhazeError, match="recompute_every needs recompute full .* got recompute selective"):
        Training(recompute="selective", recompute_every=2)
    with pytest.raises(PhazeError, match="recompute_every must be a positive integer"):
        Training(recompute="full", recompute_every=0)
    with pytest.raises(PhazeError, match="recompute_ops needs recompute selective .* got recompute full"):
        Training(recompute="full", recompute_ops=True)
    with pytest.raises(PhazeError, match="recompute_ops cannot run with recompute_modules"):
        Training(recompute="selective", recompute_ops=True, recompute_modules=["mlp"])
    assert Training(recompute="selective", recompute_ops=True).recomputed_modules == ()
    assert Training(recompute="full", recompute_every=3).recipe()["recompute_every"] == 3


def test_every_nth_block_counts_blocks_over_the_whole_model():
    """torchtitan's counter runs over all blocks, embedding and head never wrapped; n = 1 is full."""
    ordinal = np.array([0, 1, 2, 3, 4, 5, 6, 0])  # embedding, six blocks, head
    assert Training(recompute="full").checkpointed(ordinal).all()
    assert Training(recompute="full", recompute_every=2).checkpointed(ordinal).tolist() == \
        [False, False, True, False, True, False, True, False]
    assert Training(recompute="full", recompute_every=4).checkpointed(ordinal).tolist() == \
        [False] * 4 + [True] + [False] * 3
    assert not Training().checkpointed(ordinal).any()
    # the leanest-recipe order: every block checkpointed, then every second, then no recompute
    ranks = [Training(recompute="full").memory_rank(), Training(recompute="full", recompute_every=2).memory_rank(),
             Training().memory_rank()]
    assert ranks == sorted(ranks) and len(set(ranks)) == 3


# --- the op policy on a traced block against an eager run ----------------------------------------

def _torchtitan_policy(decisions):
    """torchtitan's `_custom_policy` (torchtitan/models/llama3/infra/parallelize.py), with
    `phaze::flash_attention` standing in for SDPA's flash kernel on its `_save_list`; each decision
    is recorded in call order."""
    save = {torch.ops.aten.mm.default, torch.ops.phaze.flash_attention.default}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func == torch.ops.aten.mm.default:
            counts[key] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
        if not ctx.is_recompute:
            decisions.append((func, keep))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    counts = defaultdict(int)
    return policy


class _Outputs(TorchDispatchMode):
    """Every op's output bytes in call order."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        self.log.append((func, sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))))
        return out


def _eager_kept_bytes(model) -> int:
    """Bytes torch.utils.checkpoint's selective cache holds for the block's forward under
    torchtitan's policy: the outputs of the ops the policy marks MUST_SAVE (the checkpoint caches
    them whether or not autograd would save them)."""
    block = build_layer(model, "block", 1).to_empty(device="cpu").float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(model.seq, 2, model.hidden, requires_grad=True)
    decisions = []
    with _Outputs() as outputs:
        out = checkpoint(block, x, use_reentrant=False,
                         context_fn=partial(create_selective_checkpoint_contexts, _torchtitan_policy(decisions)))
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()  # the policy's recompute runs and the gradient exists: a real checkpointed block
    assert x.grad is not None
    logged = [entry for entry in outputs.log if entry[0] in {f for f, _ in decisions}]
    assert [f for f, _ in logged] == [f for f, _ in decisions]
    return sum(size for (_, size), (_, keep) in zip(logged, decisions) if keep)


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_the_op_policy_keeps_exactly_what_torchtitans_policy_caches(layout):
    """Separate Q, K, V projections (torchtitan's Llama): matmuls wq, wk, wv, wo, fc1, fc2 keep
    wq, wv and fc1; fused (Megatron's linear_qkv): qkv, wo, fc1, fc2 keep qkv and fc1; both the
    attention output and its log-sum-exp. Float32 here, as the eager block runs."""
    model = parse_model({**TINY, "qkv_projection": layout, "dtype": "fp32"})
    traced = trace_layer_details(build_layer(model, "block", 1), example_inputs(model, "block", 2, model.seq))
    expected = _eager_kept_bytes(model)
    assert traced.op_policy_bytes == expected
    s, b, h, d = model.seq, 2, model.hidden, model.head_dim
    q, kv = model.heads * d, model.kv_heads * d
    projections = s * b * 4 * ((q + kv) if layout == "separate" else (q + 2 * kv))
    by_hand = projections + s * b * 4 * 2 * model.ffn + s * b * 4 * q + b * model.heads * s * 4
    assert expected == by_hand
    assert traced.op_policy_sp_bytes == 0  # no TP collective at width 1
    rerun = set(traced.op_policy_rerun)
    kept_gemms = [op.name for op in traced.fwd.ops if op.unit in ("tc", "tc+vc") and op.name not in rerun]
    assert len(kept_gemms) == (3 if layout == "separate" else 2) + 1  # kept matmuls + the attention kernel


def test_the_collectives_output_is_kept_and_sharded_by_sequence_parallelism():
    model = load_model("llama3-8b")
    graph = build_layer_graph(model, 2, 1, SEQ)
    block = graph.layers[1]
    s_b_h = SEQ * model.hidden * 2  # bf16
    assert block.op_policy_sp_bytes == 2 * s_b_h  # the attention's and the MLP's all-reduce (reduce-scatter with SP)
    # SP halves the checkpointed input (s b h) and both collectives' outputs (2 s b h) at TP 2
    assert block.op_policy_kept_bytes(False) - block.op_policy_kept_bytes(True) == s_b_h // 2 + s_b_h


def test_a_rerun_gemms_fp8_cast_reruns_with_it_and_a_kept_ones_does_not():
    graph = recipe_graph("llama3-8b", 1, Training(precision="fp8"))
    fwd = graph.op_graphs["block"]["fwd"]
    rerun = set(graph.extra["op_policy_rerun"]["block"])
    tags = op_policy_tags(fwd, rerun)
    gemms = [op.name for op in fwd.ops if op.datatype == "fp8"]
    casts = {op.name.rpartition(".cast_")[0]: op.name for op in fwd.ops if ".cast_" in op.name}
    assert gemms and casts and set(casts) <= set(gemms)
    for gemm, cast in casts.items():
        assert (cast in tags) == (gemm in rerun) == (gemm in tags), gemm
    assert any(g in rerun for g in casts) and any(g not in rerun for g in casts)


# --- memory and time ordered, through the evaluator ----------------------------------------------

def _stage_terms(training, graph, costs, stages):
    n = len(graph.layers)
    system = replace(load_system("dgx-h100"), accelerators=graph.tp * len(stages), global_batch=1)
    problem = PlacementProblem(costs=(costs,), system=system, hbm_bytes=2.0 ** 50, peak_flops=1.0,
                               training=training, seq_len=SEQ)
    result = evaluate_placement(problem, Placement(graph.tp, 1, stages))
    assert result.feasible, result.reason
    assert sum(len(s) for s in stages) == n
    return result


def _costs(graph, training):
    """LayerCosts as design.evaluate builds them, times from the op graphs' FLOPs (enough to order)."""
    n = len(graph.layers)
    fwd = np.array([l.fwd_flops for l in graph.layers]) * 1e-15 + 1e-6
    bwd = 2 * fwd
    return LayerCosts.from_layer_graph(graph, fwd, bwd, selective_s=0.1 * fwd,
                                       sequence_parallel=training.sequence_parallel,
                                       op_policy_s=[0.4 * f if l.kind.endswith("block") else 0.0
                                                    for f, l in zip(fwd, graph.layers)])


@pytest.mark.parametrize("sp", [False, True])
def test_memory_lies_between_none_and_full_and_recompute_grows_as_n_falls(sp):
    model = load_model("llama3-8b")
    graph = build_layer_graph(model, 2, 1, SEQ)
    n = len(graph.layers)
    stages = (tuple(range(n // 2)), tuple(range(n // 2, n)))
    runs = {}
    recipes = {"none": Training(), "full": Training(recompute="full"), "ops": Training(recompute="selective", recompute_ops=True),
               **{f"every{k}": Training(recompute="full", recompute_every=k) for k in (1, 2, 3, 4, 8, 64)}}
    for name, training in recipes.items():
        training = replace(training, sequence_parallel=sp)
        runs[name] = _stage_terms(training, graph, _costs(graph, training), stages)
    mem = {k: [s.memory_bytes for s in r.stages] for k, r in runs.items()}
    rec = {k: sum(s.recompute_s for s in r.stages) for k, r in runs.items()}
    assert mem["every1"] == mem["full"] and rec["every1"] == rec["full"]  # every block = full
    for k in ("ops", "every2", "every3", "every4", "every8"):
        for lo, mid, hi in zip(mem["full"], mem[k], mem["none"]):
            assert lo < mid < hi, k
        assert 0 < rec[k] < rec["full"], k
    assert rec["every2"] > rec["every3"] > rec["every4"] > rec["every8"] > 0
    assert mem["every2"] < mem["every4"] < mem["every8"]  # fewer checkpoints keep more, stage by stage
    assert rec["every64"] == 0 and mem["every64"] == mem["none"]  # 32 blocks: none is the 64th


def test_a_stage_pays_for_the_checkpointed_blocks_it_holds():
    """Uneven stages: each stage's recompute is the forward of exactly its blocks whose place among
    all blocks is a multiple of n, counted here by hand."""
    model = load_model("llama3-8b")
    graph = build_layer_graph(model, 2, 1, SEQ)
    n = len(graph.layers)
    training = Training(recompute="full", recompute_every=3)
    costs = _costs(graph, training)
    stages = (tuple(range(0, 5)), tuple(range(5, 17)), tuple(range(17, n)))
    result = _stage_terms(training, graph, costs, stages)
    for stage, got in zip(stages, result.stages):
        mine = [v for v in stage if graph.layers[v].name.startswith("block.")
                and (int(graph.layers[v].name.split(".")[1]) + 1) % 3 == 0]
        assert got.recompute_s == pytest.approx(sum(float(costs.fwd_s[v]) for v in mine), rel=1e-12)
