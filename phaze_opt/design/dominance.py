"""Recipes another recipe of the same design provably matches or beats, so a sweep need not evaluate them.

A rule "B dominates A" holds when, for the same architecture, HBM and microbatch, every placement's
time per batch under recipe B is no larger than under A and every stage's memory no larger, with the
same placement constraints: the placement DP's optimum under B is then at least A's throughput (and
A infeasible whenever B is). Each rule below is a fact of the cost model as written (checked in
`tests/test_dominance.py` on the traced layers and, through the brute-force placement oracle, on
random placement problems), up to floating-point rounding of equal sums:

- `overlap`: overlapped gradient reduction on beats off. The only time terms it touches are the
  data-parallel reductions (the per-batch tail, ZeRO-2's and 3's per-microbatch reduce-scatter), each
  max(0, reduction - backward) <= reduction (`solve.placement.evaluate`); memory does not depend on it.
- `sequence_parallel`: on beats off. The layer times do not depend on it (its TP collectives, a
  reduce-scatter plus an all-gather, cost exactly the ring all-reduce they replace:
  2 (g-1)/g x bytes / bw + 2 (g-1) x latency either way; `workload.collectives`), and every activation
  term (kept, checkpoint, recompute working set) only loses the 1 - 1/t of the norm and dropout
  regions it shards (`workload.ops.Layer`; Korthikanti et al. 2022, Sec. 4.2.2); the pipeline sends
  and the all-to-alls carry each rank's s/t share, no more bytes than without it.
- `zero`: ZeRO-1 beats ZeRO-0 when a weight is no wider than its gradient as reduced (the recipe's
  `reduce_dtype`, else the gradient's own width): the reduce-scatter of
  the gradients plus the all-gather of the weights moves (d-1)/d (G + W) <= 2 (d-1)/d G bytes in the
  same 2 (d-1) steps as the all-reduce, the optimizer step is divided over the replicas and so is
  the optimizer state (Rajbhandari et al., SC'20, Sec. 5.1). Not with `overlap_param_gather`: it
  moves ZeRO-1's all-gather from beside the backward (where an overlapped all-reduce hides whole)
  to beside one microbatch's forward, a shorter window, so ZeRO-1 can then expose more.
- `selective`: selective recompute equals no recompute when the attention kernel keeps no
  attention core (flash attention, Dao et al. 2022): it then drops nothing, recomputes nothing
  (`LayerCosts.selective_s` is 0 where `attention_core_bytes` is 0) and keeps the same bytes.

ZeRO-2 and 3 against ZeRO-1 (and each other), the recompute modes against each other and the virtual stage counts trade
memory for time, so no rule relates them; they stay separate points.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ..training import REDUCE_BYTES
from ..workload.graphs import build_layer_graph
from .evaluate import tp_widths

RULES = ("overlap", "sequence_parallel", "zero", "selective")


def _improve(recipe: Mapping, system, keeps_no_core: Callable[[object], bool]) -> list[tuple[str, dict]]:
    """(rule, the recipe it leads to) for every rule that applies to `recipe`."""
    out = []
    reduced = REDUCE_BYTES.get(recipe.get("reduce_dtype"), system.grad_bytes_per_param)  # Training.reduce_bytes
    weight_le_grad = system.bytes_per_element <= reduced
    if recipe.get("overlap_grad_reduce") is False:
        out.append(("overlap", {**recipe, "overlap_grad_reduce": True}))
    if recipe.get("sequence_parallel") is False:
        out.append(("sequence_parallel", {**recipe, "sequence_parallel": True}))
    if recipe.get("zero") == 0 and weight_le_grad and not recipe.get("overlap_param_gather"):
        out.append(("zero", {**recipe, "zero": 1}))
    if recipe.get("recompute") == "selective" and keeps_no_core(recipe.get("attention")) \
            and not recipe.get("recompute_modules") and not recipe.get("recompute_ops"):  # others drop more than the core
        out.append(("selective", {**recipe, "recompute": "none"}))
    return out


def dominators(recipes: Sequence[Mapping], system, keeps_no_core: Callable[[object], bool]) -> list[int]:
    """For each recipe (a dict of recipe fields as a space lists them), the index of the recipe in
    `recipes` that dominates it, following the rules as far as they lead inside the list; its own
    index when no rule leads to a listed recipe. `keeps_no_core(attention)`: whether that kernel
    keeps no attention core in any layer (for the `selective` rule)."""
    index = {_key(r): i for i, r in enumerate(recipes)}
    out = []
    for i, r in enumerate(recipes):
        current, seen = dict(r), {i}
        moved = True
        while moved:  # every rule moves to a recipe closer to all-on; the walk ends
            moved = False
            for _, better in _improve(current, system, keeps_no_core):
                j = index.get(_key(better))
                if j is not None and j not in seen:
                    current, moved = better, True
                    seen.add(j)
                    break
        out.append(index[_key(current)])
    return out


def model_dominators(recipes: Sequence[Mapping], model, system, mbs: int) -> list[int]:
    """`dominators` for `model` trained at microbatch `mbs` on `system`: the `selective` rule applies to
    a kernel that keeps no attention core in any layer at any of the model's TP widths."""
    def keeps_no_core(attention):
        return all(layer.attention_core_bytes == 0 for tp in tp_widths(model, system)
                   for layer in build_layer_graph(model, tp, mbs, attention=attention).layers)

    return dominators(recipes, system, keeps_no_core)


def _key(recipe: Mapping) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in recipe.items()))
