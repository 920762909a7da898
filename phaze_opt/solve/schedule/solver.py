"""Exact per-layer operator scheduling: the fastest schedule of one layer pass on one chip.

Semantics (the verifier in `verify.py` checks exactly these):

- Each compute op runs either on ONE core of its type ("tc": one tensor core, "vc": one vector
  core, "tc+vc": one of each together) with latency `single[i]`, or SPLIT across all cores of its
  type with latency `split[i]`. A split op runs alone: no other compute op overlaps it.
  A split mode exists only when the type has more than one core; with one core the op runs on it
  with `single[i]` (the hardware model gives split == single then).
- "net" ops (collectives) use the interconnect, not cores: they overlap compute freely but are
  serialised among themselves (one link). They take `single[i]`.
- "none" ops take zero time.
- At every instant, single-mode ops using TCs <= num_tc and using VCs <= num_vc.
- An op starts after all its predecessors finish. Objective: the makespan.

How it is solved exactly (each step is argued where it is implemented):

1. `instance.prepare`: drop dominated split modes, contract zero-time ops, compute the
   transitive closure and cut the graph into series blocks, each solved on its own.
2. `bounds`: a lower bound per block (critical path at fastest latencies, link serialisation, a
   timeline bound that mixes split time with TC and VC work over cores, and the idle time a chain
   of ops forces when too few ops can run beside them).
3. `heuristic.list_schedule`: a legal schedule by list scheduling. If it meets the lower
   bound (to 1e-9 relative, i.e. floating-point rounding), it is optimal and no solver runs
   (method "bound").
4. Otherwise, on a block of at most SEARCH_MAX_OPS ops, the compiled decision-point search
   (`search.search_block`, below) runs from the list schedule for SEARCH_FIRST_S; if it
   finishes, its schedule is proven optimal (method "search") and no LP or MIP is built. Most blocks
   close here in under a millisecond, where building and solving the MIP costs 0.1-2 s.
   Otherwise `ilp.solve_block`: first the order-free relaxation (with its partner-idle
   cuts), and a hunt for a schedule meeting its bound (its hint, restricted searches; a finished
   unrestricted search also proves); then the MIP with the best schedule so far as warm start and upper bound,
   zero gap, lazy core-limit cuts, exact realisation of the solver's answer (method "ilp"; "search"
   when the decision-point search below gave the proof). A run
   that stops at the time limit returns its best schedule as status "time_limit" with the proven
   bound, never as "optimal".
   The MIP gets MIP_FIRST_S first. A block it has not closed by then goes to
   `search.search_block`, an exact branch and bound over decision points started from the
   MIP's incumbent, for 80% of the time left; if that finishes, its schedule is optimal (it closes the
   blocks whose optimum turns on which vector ops hide beside equal single-mode GEMMs, which the
   MIP's relaxation cannot see). If not, the MIP runs again for the rest of the time, warm-started
   with the better incumbent, and the best proven bound of the phases is reported.
5. Every result is replayed by `verify.verify_schedule` before it is returned, and memoised by
   content (`cache`, method "cache" on a hit; a hit read from disk is replayed against
   the problem and its claimed bound checked before it is used, see `cache.check_hit`).
"""

from __future__ import annotations

import time

from .bounds import block_bounds
from .cache import get as cache_get
from .cache import problem_key
from .cache import put as cache_put
from .heuristic import list_schedule
from .ilp import IlpResult, solve_block
from .search import SEARCH_MAX_OPS, ensure_warm, search_block
from .instance import block_view, prepare
from .types import Schedule, ScheduleProblem
from .verify import assign_cores, expected_duration, verify_schedule

SOLVERS = ("highs", "cbc")
BOUND_REL_TOL = 1e-9  # heuristic == bound up to floating-point rounding
# A block the list schedule does not prove goes first to the compiled search for at most this long:
# on 612 benchmark blocks that reach a solver it closed 605 with a median of 0.26 ms (BENCHMARKS.md,
# "Per-layer scheduling"), where the MIP takes 0.1-2 s a block on chips of two tensor cores. A search
# that finishes is a proof (search's docstring), so nothing is lost when it does; one that
# does not hands its incumbent, at least as good as the list schedule, to the MIP.
SEARCH_FIRST_S = 0.1
PHASE_S = 4.0  # the relaxation phases of the first solve_block (ilp), before its MIP
MIP_FIRST_S = 2.0  # the MIP closes all but a few dozen benchmark blocks within this; then the search joins in
SEARCH_SHARE = 0.8  # the second MIP phase closed no benchmark block the search left open; it keeps the bound honest



def _block_solve(inst, view, solver: str, deadline: float, skip_by_bound: bool = True) -> dict:
    bounds = block_bounds(inst, view)
    lb = max(bounds.values())
    info = {"ops": len(view.ops), "lower_bound_comb": lb}
    if len(view.ops) == 1:
        i = view.ops[0]
        mode = inst.can_split[i]
        info.update(method="trivial", status="optimal", makespan=inst.best(i), lower_bound=inst.best(i),
                    start={i: 0.0}, modes={i: mode}, unordered_pairs=0, binaries=0)
        return info
    target = lb * (1.0 + BOUND_REL_TOL) if skip_by_bound else 0.0
    ms, start, modes = list_schedule(inst, view, target=target)
    info["heuristic"] = ms
    unordered = sum(1 for k, a in enumerate(view.ops) for b in view.ops[k + 1:] if inst.unordered(a, b))
    info["unordered_pairs"] = unordered
    if skip_by_bound and ms <= lb * (1.0 + BOUND_REL_TOL):
        info.update(method="bound", status="optimal", makespan=ms, lower_bound=min(lb, ms), start=start,
                    modes=modes, binaries=0)
        return info
    incumbent = (ms, start, modes)
    probe = None
    if skip_by_bound and len(view.ops) <= SEARCH_MAX_OPS and deadline > time.perf_counter():
        probe = _search_first(inst, view, incumbent, deadline)
        if probe.complete:
            info.update(method="search", status="optimal", makespan=probe.makespan, lower_bound=probe.makespan,
                        start=probe.start, modes=probe.modes, binaries=0,
                        ilp={"proof": "search", "search_first": probe.stats})
            return info
        incumbent = (probe.makespan, probe.start, probe.modes)
    left = max(deadline - time.perf_counter(), 0.0)
    res = solve_block(inst, view, incumbent, lb, solver=solver, time_limit_s=min(left, MIP_FIRST_S),
                      phase_s=min(left, PHASE_S), deadline=deadline)
    stats = dict(res.stats)
    if probe is not None:
        stats["search_first"] = probe.stats
    if res.status == "time_limit" and len(view.ops) <= SEARCH_MAX_OPS and deadline > time.perf_counter():
        res, stats = _search_then_mip(inst, view, res, stats, solver, deadline)
    method = "search" if stats.get("proof") == "search" else "ilp"
    info.update(method=method, status=res.status, makespan=res.makespan, lower_bound=min(res.lower_bound, res.makespan),
                start=res.start, modes=res.modes, binaries=stats.get("binaries", 0), ilp=stats)
    return info


def _search_first(inst, view, incumbent, deadline: float):
    """The short search before the MIP (step 4 of the module docstring); complete only if it finished.
    The kernel is loaded first, so that a process's first block does not spend its budget on that."""
    ensure_warm()
    return search_block(inst, view, incumbent, min(deadline, time.perf_counter() + SEARCH_FIRST_S))


def _search_then_mip(inst, view, res, stats, solver: str, deadline: float):
    """The MIP did not close the block in MIP_FIRST_S: search (`search`) from its incumbent
    for up to SEARCH_SHARE of the time left; if that does not finish, give the MIP the rest,
    warm-started with the better incumbent. Every phase's bound is proven, so the best of them
    stands."""
    now = time.perf_counter()
    found = search_block(inst, view, (res.makespan, res.start, res.modes), now + SEARCH_SHARE * (deadline - now))
    stats["search"] = found.stats
    if found.complete:
        stats["proof"] = "search"
        return IlpResult(found.makespan, found.makespan, "optimal", found.start, found.modes, stats), stats
    incumbent = (found.makespan, found.start, found.modes)
    again = solve_block(inst, view, incumbent, res.lower_bound, solver=solver,
                        time_limit_s=max(deadline - time.perf_counter(), 0.0), quick_search=False)
    stats["second_mip"] = again.stats
    # solve_block returns the better of its own schedule and the incumbent it was given.
    bound = min(max(res.lower_bound, again.lower_bound), again.makespan)
    return IlpResult(again.makespan, bound, again.status, again.start, again.modes, stats), stats


def core_utilisation(problem: ScheduleProblem, split, duration, makespan: float) -> dict:
    if makespan <= 0:
        return {"tc": 0.0, "vc": 0.0}
    tc = vc = 0.0
    for i, u in enumerate(problem.units):
        d = duration[i]
        if u in ("tc", "tc+vc"):
            tc += d * (problem.num_tc if split[i] else 1)
        if u in ("vc", "tc+vc"):
            vc += d * (problem.num_vc if split[i] else 1)
    return {"tc": tc / (problem.num_tc * makespan) if problem.num_tc else 0.0,
            "vc": vc / (problem.num_vc * makespan) if problem.num_vc else 0.0}


def solve_schedule(problem: ScheduleProblem, *, solver: str = "highs", time_limit_s: float = 60.0,
                   cache: bool = True, skip_by_bound: bool = True) -> Schedule:
    """The minimum-makespan schedule of `problem`, proven optimal unless `status` says otherwise.

    `solver` is "highs" (in-process, default) or "cbc"; `time_limit_s` bounds the whole call.
    With `cache`, results are memoised by content in memory and under `$PHAZE_OPT_CACHE`.
    `skip_by_bound=False` runs the ILP on every block even when the list schedule already meets
    the lower bound or a short search could prove it (for tests and measurements of the MIP; results
    are the same, only slower).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    key = problem_key(problem) if cache else None
    if cache:
        hit = cache_get(key, solver, time_limit_s, problem=problem)
        if hit is not None:
            extra = dict(hit.extra, solved_by=hit.method, original_solve_s=hit.solve_s)
            return Schedule(makespan=hit.makespan, lower_bound=hit.lower_bound, status=hit.status, method="cache",
                            solve_s=time.perf_counter() - t0, start=hit.start, split=hit.split, cores=hit.cores,
                            duration=hit.duration, extra=extra)
    sched = _solve(problem, solver, time_limit_s, t0, skip_by_bound)
    if cache:
        cache_put(key, sched, solver, time_limit_s)
    return sched


def _solve(problem: ScheduleProblem, solver: str, time_limit_s: float, t0: float, skip_by_bound: bool) -> Schedule:
    inst = prepare(problem)
    deadline = t0 + time_limit_s
    n = inst.n
    start = [0.0] * n
    split = [False] * n
    offset = 0.0
    lower = 0.0
    blocks = []
    for b in inst.blocks:
        info = _block_solve(inst, block_view(inst, b), solver, deadline, skip_by_bound)
        for i in b:
            start[i] = offset + info["start"][i]
            split[i] = bool(info["modes"][i])
        offset += info["makespan"]
        lower += info["lower_bound"]
        blocks.append(info)
    for i in range(n):
        if inst.zero[i]:
            split[i] = inst.zero_split[i]
    duration = [expected_duration(problem, i, split[i]) for i in range(n)]
    for i in inst.topo:  # zero-time ops at the latest finish of their predecessors
        if inst.zero[i]:
            start[i] = max((start[p] + duration[p] for p in inst.preds[i]), default=0.0)
    makespan = max((start[i] + duration[i] for i in range(n)), default=0.0)
    statuses = {blk["status"] for blk in blocks}
    status = "error" if "error" in statuses else ("time_limit" if "time_limit" in statuses else "optimal")
    methods = [blk["method"] for blk in blocks]
    method = next((m for m in ("search", "ilp") if m in methods), "bound")  # the strongest machinery used
    cores = assign_cores(problem, start, duration, split)
    extra = {
        "solver": solver,
        "ops": n,
        "real_ops": len(inst.real),
        "blocks": len(blocks),
        "largest_block": max((blk["ops"] for blk in blocks), default=0),
        "unordered_pairs": sum(blk["unordered_pairs"] for blk in blocks),
        "binaries": sum(blk["binaries"] for blk in blocks),
        "blocks_by_method": {m: methods.count(m) for m in sorted(set(methods))},
        "ilp_blocks": [dict(blk["ilp"], heuristic_s=blk["heuristic"], lower_bound_comb_s=blk["lower_bound_comb"])
                       for blk in blocks if blk["method"] in ("ilp", "search")],
        "lower_bound_comb": sum(blk["lower_bound_comb"] for blk in blocks),
        "heuristic_makespan": sum(blk.get("heuristic", blk["makespan"]) for blk in blocks),
        "utilisation": core_utilisation(problem, split, duration, makespan),
    }
    sched = Schedule(makespan=makespan, lower_bound=min(lower, makespan), status=status, method=method,
                     solve_s=time.perf_counter() - t0, start=tuple(start), split=tuple(split), cores=cores,
                     duration=tuple(duration), extra=extra)
    verify_schedule(problem, sched)
    return sched


def problem_from_graph(op_graph, single_row, split_row, num_tc: int, num_vc: int) -> ScheduleProblem:
    """The scheduling problem of an `OpGraph` with per-op latency rows (seconds) on a chip."""
    ops = op_graph.ops
    if len(single_row) != len(ops) or len(split_row) != len(ops):
        raise ValueError(f"{op_graph.layer}/{op_graph.pass_name}: {len(ops)} ops but latency rows of "
                         f"{len(single_row)} and {len(split_row)}")
    return ScheduleProblem(
        units=tuple(op.unit for op in ops), single=tuple(float(v) for v in single_row),
        split=tuple(float(v) for v in split_row), edges=tuple(tuple(e) for e in op_graph.edges),
        num_tc=int(num_tc), num_vc=int(num_vc), names=tuple(op.name for op in ops),
    )


def schedule_graph(op_graph, single_row, split_row, accel, *, solver: str = "highs", time_limit_s: float = 60.0,
                   cache: bool = True) -> Schedule:
    """Schedule one layer pass on an `Accelerator`; memoised by content (memory and disk)."""
    problem = problem_from_graph(op_graph, single_row, split_row, accel.num_tc, accel.num_vc)
    return solve_schedule(problem, solver=solver, time_limit_s=time_limit_s, cache=cache)
