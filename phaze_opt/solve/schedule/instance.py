"""A scheduling problem made ready for the solvers: validated, contracted and cut into blocks.

Everything here is a reformulation that provably keeps the optimum (each rule says why):

1. Modes. A split mode exists only when the op's type has more than one core (for "tc+vc": more
   than one TC or VC); with one core the op runs on it with `single[i]` and `split[i]` is ignored
   (the hardware model gives the same number). A split mode that is not strictly faster than the
   single mode is dropped: a split op at [s, s + split] excludes every other compute op, so one
   core of its type is free over [s, s + single], which is no longer, and moving the op there
   keeps every precedence and core limit.

2. Zero-time ops ("none" ops, and any op whose fastest mode takes 0 s, e.g. a TP=1 all-reduce)
   are contracted: a zero-length interval overlaps nothing, so such an op only passes precedence
   on. We keep reachability (the transitive closure over all ops) and schedule it afterwards at
   the latest finish of its predecessors.

3. Series blocks. If the remaining ops split into a prefix D and the rest R such that every op of
   D is an ancestor of every op of R, then every schedule runs all of D before any of R, so its
   makespan is at least OPT(D) + OPT(R), and concatenating optimal schedules of D and R achieves
   that. Such D is a prefix of every topological order, so scanning the prefixes of one order
   finds every cut. Pairs the DAG leaves unordered therefore only ever lie inside one block.

Reachability is kept as Python integers used as bitsets (bit j of `desc[i]` set: j is reachable
from i), which makes closure, unordered-pair and cut tests a few machine words per op.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from .types import ScheduleProblem
from .verify import has_split_mode

COMPUTE_UNITS = ("tc", "vc", "tc+vc")


def set_bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass(frozen=True)
class Instance:
    """Per-op facts the solvers need, for the ops of the original problem (same indices)."""

    problem: ScheduleProblem
    n: int
    num_tc: int
    num_vc: int
    unit: tuple[str, ...]
    single: tuple[float, ...]  # the single-mode latency (net: the collective's time; none: 0)
    split: tuple[float, ...]  # the split-mode latency where `can_split`, else equal to `single`
    can_split: tuple[bool, ...]  # a split mode exists and is strictly faster than single
    uses_tc: tuple[bool, ...]  # in single mode
    uses_vc: tuple[bool, ...]
    compute: tuple[bool, ...]
    net: tuple[bool, ...]
    zero: tuple[bool, ...]  # contracted: takes 0 s in its fastest mode
    zero_split: tuple[bool, ...]  # a zero op whose 0 s mode is the split one
    topo: tuple[int, ...]  # a topological order of all ops
    preds: tuple[tuple[int, ...], ...]  # original predecessors (deduplicated)
    desc: tuple[int, ...]  # bitset of ops reachable from i (i excluded)
    anc: tuple[int, ...]  # bitset of ops that reach i
    real: tuple[int, ...]  # non-zero ops in topological order
    red_preds: dict  # real op -> its real predecessors in the transitive reduction
    blocks: tuple[tuple[int, ...], ...]  # series blocks of real ops, each in topological order

    def best(self, i: int) -> float:
        return self.split[i] if self.can_split[i] else self.single[i]

    def unordered(self, i: int, j: int) -> bool:
        return i != j and not (self.desc[i] >> j) & 1 and not (self.desc[j] >> i) & 1

    def ordered_before(self, i: int, j: int) -> bool:
        return bool((self.desc[i] >> j) & 1)


def _validate(p: ScheduleProblem) -> None:
    n = len(p.units)
    for name, values in (("single", p.single), ("split", p.split)):
        for i, v in enumerate(values):
            if not (isinstance(v, (int, float)) or hasattr(v, "__float__")) or not math.isfinite(float(v)) or float(v) < 0:
                raise ValueError(f"{name}[{i}] = {v!r}: latencies must be finite and >= 0 seconds")
    for e in p.edges:
        if len(e) != 2 or not all(isinstance(v, int) and 0 <= v < n for v in e) or e[0] == e[1]:
            raise ValueError(f"edge {e!r}: must join two different ops among {n}")
    needs_tc = any(u in ("tc", "tc+vc") for u in p.units)
    needs_vc = any(u in ("vc", "tc+vc") for u in p.units)
    if (needs_tc and p.num_tc < 1) or (needs_vc and p.num_vc < 1) or p.num_tc < 0 or p.num_vc < 0:
        raise ValueError(f"{p.num_tc} TC / {p.num_vc} VC cannot run ops of units {sorted(set(p.units))}")


def _toposort(n: int, succs: list[list[int]], preds: list[list[int]]) -> list[int]:
    """Kahn's algorithm, smallest index first among ready ops, so the order is deterministic."""
    indeg = [len(preds[i]) for i in range(n)]
    heap = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for s in succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, s)
    if len(order) != n:
        raise ValueError("the op graph has a cycle")
    return order


def prepare(problem: ScheduleProblem) -> Instance:
    _validate(problem)
    n = len(problem.units)
    units = tuple(problem.units)
    succs: list[list[int]] = [[] for _ in range(n)]
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in sorted(set(problem.edges)):
        succs[a].append(b)
        preds[b].append(a)
    topo = _toposort(n, succs, preds)
    single, split, can_split, zero, zero_split = [], [], [], [], []
    for i, u in enumerate(units):
        s1 = float(problem.single[i])
        s2 = float(problem.split[i])
        if u == "none":
            s1 = 0.0
        splittable = has_split_mode(u, problem.num_tc, problem.num_vc)
        faster = splittable and s2 < s1
        single.append(s1)
        split.append(s2 if faster else s1)
        can_split.append(faster)
        best = s2 if faster else s1
        zero.append(best == 0.0)
        zero_split.append(best == 0.0 and faster)
    uses_tc = tuple(u in ("tc", "tc+vc") for u in units)
    uses_vc = tuple(u in ("vc", "tc+vc") for u in units)

    desc = [0] * n
    for i in reversed(topo):
        m = 0
        for s in succs[i]:
            m |= (1 << s) | desc[s]
        desc[i] = m
    anc = [0] * n
    for i in topo:
        m = 0
        for p in preds[i]:
            m |= (1 << p) | anc[p]
        anc[i] = m

    real = tuple(i for i in topo if not zero[i])
    real_mask = 0
    for i in real:
        real_mask |= 1 << i
    red_preds: dict[int, tuple[int, ...]] = {}
    for i in real:
        a = anc[i] & real_mask
        covered = 0
        for p in set_bits(a):
            covered |= anc[p]
        red_preds[i] = tuple(sorted(set_bits(a & ~covered)))

    blocks: list[tuple[int, ...]] = []
    current: list[int] = []
    common = -1  # AND of desc over the ops of the current prefix
    rest = real_mask
    for i in real:
        current.append(i)
        rest &= ~(1 << i)
        common &= desc[i]
        if (common & rest) == rest:  # every op so far reaches every op after: a series cut
            blocks.append(tuple(current))
            current = []
            common = -1
    if current:
        blocks.append(tuple(current))

    return Instance(
        problem=problem, n=n, num_tc=int(problem.num_tc), num_vc=int(problem.num_vc), unit=units,
        single=tuple(single), split=tuple(split), can_split=tuple(can_split), uses_tc=uses_tc, uses_vc=uses_vc,
        compute=tuple(u in COMPUTE_UNITS for u in units), net=tuple(u == "net" for u in units),
        zero=tuple(zero), zero_split=tuple(zero_split), topo=tuple(topo), preds=tuple(tuple(p) for p in preds),
        desc=tuple(desc), anc=tuple(anc), real=real, red_preds=red_preds, blocks=tuple(blocks),
    )


def max_antichain(ops: list[int], desc) -> int:
    """Width of the poset on `ops` (Dilworth): |ops| minus a maximum matching of a < b pairs."""
    idx = {o: k for k, o in enumerate(ops)}
    adj = [[idx[b] for b in ops if (desc[a] >> b) & 1] for a in ops]
    match_right = [-1] * len(ops)

    def augment(u: int, seen: list[bool]) -> bool:
        for v in adj[u]:
            if not seen[v]:
                seen[v] = True
                if match_right[v] == -1 or augment(match_right[v], seen):
                    match_right[v] = u
                    return True
        return False

    matched = sum(augment(u, [False] * len(ops)) for u in range(len(ops)))
    return len(ops) - matched


@dataclass(frozen=True)
class BlockView:
    """One series block with its precedence restricted to itself.

    Any path between two ops of a block stays inside the block (an op between them in the DAG is
    after the first and before the second, so it cannot sit in an earlier or a later block), so
    the transitive reduction restricted to the block is the block's own reduction.
    """

    ops: tuple[int, ...]  # topological order
    mask: int
    preds: dict  # op -> reduced predecessors inside the block
    succs: dict  # op -> reduced successors inside the block


def block_view(inst: Instance, block: tuple[int, ...]) -> BlockView:
    mask = 0
    for i in block:
        mask |= 1 << i
    preds = {i: tuple(p for p in inst.red_preds[i] if (mask >> p) & 1) for i in block}
    succs: dict[int, list[int]] = {i: [] for i in block}
    for i in block:
        for p in preds[i]:
            succs[p].append(i)
    return BlockView(ops=tuple(block), mask=mask, preds=preds, succs={i: tuple(s) for i, s in succs.items()})


def longest_heads(view: BlockView, dur) -> dict:
    """Earliest start of every op inside its block when op i takes dur[i]."""
    head = {}
    for i in view.ops:
        head[i] = max((head[p] + dur[p] for p in view.preds[i]), default=0.0)
    return head


def longest_tails(view: BlockView, dur) -> dict:
    """Longest time from the end of op i to the end of its block, op i itself excluded."""
    tail = {}
    for i in reversed(view.ops):
        tail[i] = max((tail[s] + dur[s] for s in view.succs[i]), default=0.0)
    return tail
