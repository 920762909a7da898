"""The exact mixed-integer program for one series block, solved with PuLP (HiGHS by default).

Variables (times are scaled so the incumbent's makespan is 1000, which keeps the solver's absolute
tolerances far below any latency that matters):

- S_i >= 0 continuous start of op i, within its window [head_i, UB - tail_i - dmin_i] (head and
  tail are longest paths with fastest latencies; only schedules no longer than the incumbent UB
  matter, so the windows cut nothing useful);
- x_i binary, 1 when op i runs split, only for ops where the split mode exists, is strictly faster,
  and where it could matter (see "solo ops");
- order binaries y_ab ("a ends before b starts") only for pairs the DAG leaves unordered and only
  where the pair can interact: two collectives (one link), two compute ops of which either may run
  split, two compute ops sharing a one-core resource, and (lazily, see below) two single-mode ops
  competing for a resource with more cores. Ordered pairs get no variable; their precedence is one
  constraint per edge of the transitive reduction.

Constraints:
- precedence  S_b >= S_a + d_a with d_a = single_a + (split_a - single_a) x_a;
- disjunction S_b >= S_a + d_a - M_ab (1 - y_ab), with the tightest valid M_ab = (UB - tail_a) -
  head_b; where M_ab <= 0 the order is forced and no variable is created, and where a cannot end
  before b could start y_ab is fixed to 0;
- a pair that must never overlap (link, one-core resource): y_ab + y_ba = 1 (one binary);
- split exclusivity: y_ab + y_ba >= x_a, >= x_b, and <= 1;
- makespan C >= S_i + d_i for the block's sinks.

Valid inequalities that make the relaxation strong (see `bounds`): with T the time no split op
runs, C >= sum_i split_i x_i + T; T >= single-mode TC work / num_tc; T >= single-mode VC work /
num_vc; T >= L_i where L_i >= (1 - x_i) single_i + L_p along compute precedence (the longest chain
of single-mode ops, which run one after another and only while no split op runs); and C >= the
link bound. Idle-chain cuts (also `bounds.idle_chain_bound`): while op i runs in single mode only
users of a resource incomparable with i can run beside it, at most the width W_i of that set, so
g_i = cores - u_i - W_i cores idle along i; ops of a chain P run at disjoint times, so
cores * C >= busy core time + sum_{i in P} g_i (1 - x_i) single_i, added for the heaviest chain
through each op. They see a TC waiting while a vector op or a collective runs with too few
independent TC ops beside it. Anchored at every op j (relaxation only, see `relaxation_bound`): the compute ops
after j run inside [S_j + d_j, C], so C >= S_j + d_j + their split time + T_post_j, where T_post_j
is bounded like T by their single-mode work over cores and by the longest chain of single-mode
ops among them (R_i, the chain starting at i); likewise the ops before j run inside [0, S_j]. They
see idle time that precedence forces, e.g. a core waiting on a collective, which the unanchored
cuts cannot. Partner-idle cuts (relaxation only, `_partner_idle_cuts`): while op i runs single,
the ops that can keep the other cores busy are single-mode users unordered with i, one core per
chain of them, for no longer than their own single time, and not across an op that runs split
between them (it keeps i to one side); the idle left over along a chain of ops adds to the
timeline. They are separated on the relaxation's modes for a few rounds (each round's optimum is
a bound). They see what makes a vector-heavy block's optimum: which vector ops pair up in single
mode beside which GEMMs, and which one-cycle ops some pair can host. Identical ops (same unit, latencies, ancestors and descendants) are interchangeable,
so S_a <= S_b for a before b in index order, and y_ba = 0 (symmetry breaking).

Closing a block (`solve_block`). The relaxation is solved first; if the incumbent meets its
bound, done. Otherwise, since the relaxation is often exact where the incumbent is not, we look
for a schedule that meets it: list schedules in its modes and order, the decision-point search
restricted to its split GEMMs, the unrestricted search for QUICK_SEARCH_S (a search that finishes
proves optimality by itself), and the search restricted to the ops whose modes the incumbent and
the relaxation disagree on. These only produce legal schedules; optimality comes from a bound or
a finished unrestricted search. Then the full MIP below.

Core limits. Capacity is only at stake for a resource whose largest antichain of users in the block
(Dilworth: ops minus a maximum matching of the comparability graph) exceeds its core count; else
there is no constraint at all. One-core resources use the pairwise disjunction above. For
k >= 2 cores we first solve without core limits, as the published system does; if the schedule
runs more than k single-mode users at once, instead of adding per-core assignment variables we add
the cut "among these k+1 ops, at least one pair is ordered": sum of their y over pairs >= 1. It is
valid (intervals that pairwise overlap share a point, Helly, so a legal schedule cannot have k+1
pairwise-overlapping users) and it is all that is needed (if no k+1 users pairwise overlap, no
instant has k+1 users). We re-solve until the schedule fits; each relaxation's optimum is a lower
bound, so the last one, which fits, is optimal. Then greedy interval colouring names the cores.

Realisation. The solver's start times carry its tolerances, so we never report them directly: we
keep its modes, keep every order its binaries (or a forced order) decide, order every other
interacting pair that its start times leave non-overlapping, all along one linear extension that
follows its start times, and recompute exact earliest starts by longest path. Orders come from
the binaries, not the times, because a binary at 1 within the integrality tolerance still lets
the pair overlap by M * tol, and CBC's values come back as text with 8 significant digits. The
schedule overlaps only pairs the model lets overlap, so it obeys every rule exactly (capacity is
re-checked) and ends no later than the solver's, up to rounding.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
import warnings
from dataclasses import dataclass, field

import pulp

from ... import interrupt
from .heuristic import duration, schedule_from_hint
from .bounds import idle_width
from .instance import BlockView, Instance, longest_heads, longest_tails, max_antichain, set_bits
from .search import SEARCH_MAX_OPS, ensure_warm, search_block

SCALE_TARGET = 1000.0
WINDOW_SLACK = 1e-7  # relative widening of the UB-based windows so the incumbent stays feasible
ORDER_TOL = 1e-6  # in scaled units: "a ends before b starts" in the solver's answer
CBC_ORDER_TOL = 1e-4  # CBC's values come back as text with 8 significant digits (1e-5 at 1000)
PROVEN_REL_GAP = 1e-6  # realised makespan vs. the solver's bound when it says "optimal"
MAX_CUT_SUBSETS = 20
RELAXATION_REL_TOL = 1e-9  # incumbent == relaxation bound up to rounding (times are scaled to 1000)
PARTNER_ROUNDS = 10  # separation rounds of the partner-idle cuts in the relaxation
RELAXATION_ROUND_MIN_S = 0.05  # no further round with less time left than this
RELAXATION_MAX_S = 1.0  # the relaxation's share of solve_block's time
HINT_SEARCH_S = 0.5  # the restricted search for a schedule meeting the relaxation bound (see solve_block)
QUICK_SEARCH_S = 0.3  # then the full decision-point search, before the MIP (see solve_block)
HINT_ROUNDS = 3  # relaxation phases while each finds a better incumbent (see solve_block)
HINT_RETRY_GAP = 1e-4  # ... and ends within this relative gap of the relaxation's bound

DISJ, SPLIT, CAP = "disj", "split", "cap"


def _add_ge(prob: pulp.LpProblem, terms: dict, constant: float = 0.0) -> None:
    """Add the row sum(coefficient * variable) + constant >= 0. PuLP's operators copy an expression
    for every term they add; a row of a block's O(ops^2) cuts built that way cost more than solving
    the relaxation, built from its coefficients it costs one pass."""
    prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms, constant), pulp.LpConstraintGE))


@dataclass
class IlpResult:
    makespan: float  # seconds, of the realised schedule (the better of it and the incumbent)
    lower_bound: float  # seconds, proven
    status: str  # optimal | time_limit | error
    start: dict
    modes: dict
    stats: dict = field(default_factory=dict)


# HiGHS's own log off: PuLP's msg=False sets output_flag only, and log_to_console keeps the console
# quiet should anything turn output_flag back on. Both options exist in every highspy the project
# allows (>=1.15,<2) and are set through setOptionValue, which all of them accept.
QUIET_OPTIONS = {"output_flag": False, "log_to_console": False}


def quiet_highs():
    """A `highspy.Highs` that never writes HiGHS's banner ("Running HiGHS x.y.z ... Copyright") or
    log. The banner is written by the first model-changing call while output_flag is still on, and
    from highspy 1.16 `Highs.__init__` makes one itself (`enableCallbacks` -> `setCallback`), before
    PuLP, or anyone holding the object, can set an option; so the options go in first, in the one
    step the constructor takes before that call."""
    import highspy

    class _QuietHighs(highspy.Highs):
        def enableCallbacks(self):
            for key, value in QUIET_OPTIONS.items():
                self.setOptionValue(key, value)
            super().enableCallbacks()

    highs = _QuietHighs()
    for key, value in QUIET_OPTIONS.items():  # also where a later highspy stops calling enableCallbacks there
        highs.setOptionValue(key, value)
    return highs


class _WarmHiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS, silent (`quiet_highs`), handing the incumbent to the solver before it
    runs, and stopping it when a stop is requested (Ctrl-C, SIGTERM, SIGHUP): the interpreter cannot
    run a signal's handler while HiGHS runs, so HiGHS asks at each of its interrupt callbacks (simplex
    iteration, IPM iteration, MIP node loop), and the run then ends with KeyboardInterrupt, never a
    result."""

    def __init__(self, start_values: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.start_values = start_values or {}

    def createAndConfigureSolver(self, lp):
        # PuLP's own builds a plain highspy.Highs(), which writes the banner before PuLP sets msg=False's
        # output_flag; these are the options it would set (PuLP's callback hooks are not used here)
        lp.solverModel = quiet_highs()
        options = {"mip_rel_gap": self.gapRel, "mip_abs_gap": self.gapAbs, "threads": self.threads,
                   "time_limit": None if self.timeLimit is None else float(self.timeLimit), **self.optionsDict}
        for key, value in options.items():
            if value is not None:
                lp.solverModel.setOptionValue(key, value)

    def callSolver(self, lp):
        if self.start_values:
            import highspy

            values = [0.0] * lp.solverModel.getNumCol()
            for var in lp.variables():
                values[var.index] = float(self.start_values.get(var.name, var.lowBound or 0.0))
            sol = highspy.HighsSolution()
            sol.col_value = values
            sol.value_valid = True
            lp.solverModel.setSolution(sol)
        highs = lp.solverModel
        with interrupt.polled() as stop:
            if stop.cut:
                def poll(event):
                    if stop():
                        event.interrupt()

                for callback in (highs.cbSimplexInterrupt, highs.cbIpmInterrupt, highs.cbMipInterrupt):
                    callback.subscribe(poll)
            highs.run()


def _run_solver(prob: pulp.LpProblem, solver: str, time_limit: float, warm: dict):
    """Solve; return (proven_optimal, has_solution, dual_bound or None, nodes)."""
    time_limit = max(time_limit, 0.01)
    if solver == "highs":
        import highspy

        s = _WarmHiGHS(start_values=warm, msg=False, gapRel=0.0, gapAbs=0.0, threads=1, timeLimit=time_limit,
                       mip_feasibility_tolerance=1e-9, primal_feasibility_tolerance=1e-9,
                       random_seed=0)
        prob.solve(s)
        h = prob.solverModel
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInterrupt:  # cut short: neither a bound nor a schedule
            raise KeyboardInterrupt("HiGHS interrupted")
        info = h.getInfo()
        has = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        optimal = status == highspy.HighsModelStatus.kOptimal
        if optimal:  # an LP (no binary left) reports no MIP bound; its optimum is the bound
            bound = info.objective_function_value
        else:
            bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
        return optimal, has, bound, max(int(info.mip_node_count), 0)
    if solver == "cbc":
        for var in prob.variables():
            if var.name in warm:  # into the bounds: the incumbent's scaled starts can miss them by rounding
                val = warm[var.name]
                if var.lowBound is not None:
                    val = max(val, var.lowBound)
                if var.upBound is not None:
                    val = min(val, var.upBound)
                var.setInitialValue(val)
        with warnings.catch_warnings():  # PuLP 3.3 marks its bundled CBC as deprecated for 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            # CBC's integrality tolerance (1e-6 by default) times a big-M of ~1000 would let an
            # "ordered" pair overlap by 1e-3; tighten it and the primal tolerance like HiGHS's.
            s = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=0.0, gapAbs=0.0, warmStart=bool(warm),
                                  threads=1, options=["integerTolerance 1e-9", "primalTolerance 1e-9"])
            prob.solve(s)
        optimal = prob.status == pulp.LpStatusOptimal and prob.sol_status == pulp.LpSolutionOptimal
        has = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        return optimal, has, (pulp.value(prob.objective) if optimal else None), -1
    raise ValueError(f"unknown solver {solver!r}: choose highs or cbc")


def _linear_order(view: BlockView, key: dict, before=()) -> list[int] | None:
    """A topological order of the block plus the pairs `before` ((a, b): a first) that follows
    `key` (start times) where they allow; None when `before` closes a cycle."""
    succs = {i: list(view.succs[i]) for i in view.ops}
    remaining = {i: len(view.preds[i]) for i in view.ops}
    for a, b in before:
        succs[a].append(b)
        remaining[b] += 1
    pos = {i: k for k, i in enumerate(view.ops)}
    heap = [(key[i], pos[i], i) for i in view.ops if remaining[i] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, i = heapq.heappop(heap)
        order.append(i)
        for j in succs[i]:
            remaining[j] -= 1
            if remaining[j] == 0:
                heapq.heappush(heap, (key[j], pos[j], j))
    return order if len(order) == len(view.ops) else None


def realise(inst: Instance, view: BlockView, modes: dict, approx_start: dict, interacting: list, tol: float,
            before=()) -> dict:
    """Exact earliest starts that keep every non-overlap of the solver's answer (see module doc).

    `before` holds the pairs (a, b) that the model orders a first: its order binaries at 1 and the
    orders it forced without a variable. They are kept as given. Every other interacting pair is
    kept apart when the start times say it does not overlap (to `tol`). The binaries are what
    makes this exact: a binary at 1 (up to the solver's integrality tolerance eps) still allows
    S_b >= S_a + d_a - M * eps, and a solver that returns its values as text (CBC: 8 significant
    digits) loses more than any sensible `tol`, so reading an ordered pair from start times alone
    can see an overlap the model forbids (a split op overlapped, a capacity cut undone).
    """
    before = list(before)
    order = _linear_order(view, approx_start, before)
    if order is None:  # only with durations below the solver's tolerances; orient by start time
        order = _linear_order(view, approx_start)
    pos = {i: k for k, i in enumerate(order)}
    ordered = {(a, b) for a, b in before} | {(b, a) for a, b in before}
    approx_end = {i: approx_start[i] + duration(inst, i, modes[i]) for i in view.ops}
    extra: dict[int, list[int]] = {i: [] for i in view.ops}
    for a, b in interacting:
        if pos[a] > pos[b]:
            a, b = b, a
        if (a, b) in ordered or approx_end[a] <= approx_start[b] + tol:
            extra[b].append(a)
    start: dict[int, float] = {}
    for i in order:
        start[i] = max((start[p] + duration(inst, p, modes[p]) for p in (*view.preds[i], *extra[i])), default=0.0)
    return start


def capacity_violations(inst: Instance, view: BlockView, start: dict, modes: dict, tol: float) -> list[tuple[str, list[int]]]:
    """(resource, ops running together) wherever more single-mode users than cores run at once."""
    found = []
    for resource, cap, uses in (("tc", inst.num_tc, inst.uses_tc), ("vc", inst.num_vc, inst.uses_vc)):
        users = [i for i in view.ops if inst.compute[i] and uses[i] and not modes[i]]
        if len(users) <= cap:
            continue
        end = {i: start[i] + duration(inst, i, False) for i in users}
        seen = set()
        for i in users:
            t = start[i]
            running = tuple(sorted(j for j in users if start[j] <= t + tol and end[j] > t + tol))
            if len(running) > cap and running not in seen:
                seen.add(running)
                found.append((resource, list(running)))
    return found


class BlockModel:
    """The MIP of one block, kept between lazy capacity rounds."""

    def __init__(self, inst: Instance, view: BlockView, incumbent, lower_bound: float, with_pairs: bool = True,
                 anchored: bool = False):
        self.inst, self.view = inst, view
        self.with_pairs = with_pairs
        self.anchored = anchored
        ub_s, inc_start, inc_modes = incumbent
        self.scale = ub_s / SCALE_TARGET
        sc = self.scale
        ops = view.ops
        self.ub = SCALE_TARGET * (1.0 + WINDOW_SLACK)
        self.s1 = {i: inst.single[i] / sc for i in ops}
        self.s2 = {i: inst.split[i] / sc for i in ops}
        dmin = [0.0] * inst.n
        for i in ops:
            dmin[i] = min(self.s1[i], self.s2[i])
        self.head = longest_heads(view, dmin)
        self.tail = longest_tails(view, dmin)
        self.dmin = dmin
        self.stats = {"ops": len(ops)}
        self._classify()
        self._build(lower_bound / sc)
        self.warm = self._warm_values(inc_start, inc_modes, ub_s)

    # -- pair analysis -------------------------------------------------------------------------
    def _classify(self) -> None:
        inst, view = self.inst, self.view
        ops = view.ops
        tight = {}
        for resource, cap, uses in (("tc", inst.num_tc, inst.uses_tc), ("vc", inst.num_vc, inst.uses_vc)):
            users = [i for i in ops if inst.compute[i] and uses[i]]
            tight[resource] = cap >= 2 and len(users) > cap and max_antichain(users, inst.desc) > cap
        self.tight = tight
        self.pairs: dict[tuple[int, int], str] = {}
        self.interacting: list[tuple[int, int]] = []
        unordered = 0
        for k, a in enumerate(ops):
            for b in ops[k + 1:]:
                if not inst.unordered(a, b):
                    continue
                unordered += 1
                if inst.net[a] and inst.net[b]:
                    self.pairs[(a, b)] = DISJ
                elif inst.compute[a] and inst.compute[b]:
                    share_tc = inst.uses_tc[a] and inst.uses_tc[b]
                    share_vc = inst.uses_vc[a] and inst.uses_vc[b]
                    if (share_tc and inst.num_tc == 1) or (share_vc and inst.num_vc == 1):
                        self.pairs[(a, b)] = DISJ
                    elif inst.can_split[a] or inst.can_split[b]:
                        self.pairs[(a, b)] = SPLIT
                    elif (share_tc and tight["tc"]) or (share_vc and tight["vc"]):
                        self.pairs[(a, b)] = CAP
                if (a, b) in self.pairs or (inst.compute[a] and inst.compute[b]):
                    self.interacting.append((a, b))
        involved = set()
        for a, b in self.pairs:
            involved.add(a)
            involved.add(b)
        # A solo op interacts with nothing: no compute op may overlap it, or it cannot split and
        # shares no scarce resource. Its fastest mode is then always at least as good.
        self.free_mode = {i for i in ops if inst.can_split[i] and i in involved}
        self.fixed_split = {i for i in ops if inst.can_split[i] and i not in involved}
        self.stats.update(unordered_pairs=unordered, solo_ops=len(ops) - len(involved),
                          tight_tc=tight["tc"], tight_vc=tight["vc"])

    def _twins(self) -> list[tuple[int, int]]:
        inst = self.inst
        groups: dict[tuple, list[int]] = {}
        for i in self.view.ops:
            key = (inst.unit[i], inst.single[i], inst.split[i], inst.can_split[i], inst.anc[i], inst.desc[i])
            groups.setdefault(key, []).append(i)
        out = []
        for g in groups.values():
            g.sort()
            out.extend(zip(g, g[1:]))
        return out

    # -- model ---------------------------------------------------------------------------------
    def d(self, i):
        if i in self.free_mode:
            return self.s1[i] + (self.s2[i] - self.s1[i]) * self.x[i]
        return self.s2[i] if i in self.fixed_split else self.s1[i]

    def _big_m(self, a: int, b: int) -> float:
        """Largest possible S_a + d_a - S_b in a schedule no longer than UB."""
        return (self.ub - self.tail[a]) - self.head[b]

    def _build(self, lb_scaled: float) -> None:
        inst, view = self.inst, self.view
        ops = view.ops
        prob = pulp.LpProblem("block", pulp.LpMinimize)
        self.prob = prob
        self.C = self.prob.add_variable("C", lowBound=min(lb_scaled, self.ub), upBound=self.ub)
        prob += self.C
        self.S = {i: self.prob.add_variable(f"S_{i}", lowBound=self.head[i],
                                     upBound=max(self.head[i], self.ub - self.tail[i] - self.dmin[i]))
                  for i in ops}
        self.x = {i: self.prob.add_variable(f"x_{i}", cat="Binary") for i in sorted(self.free_mode)}
        self.y: dict[tuple[int, int], pulp.LpVariable] = {}
        self.n_cuts = 0
        self.cut_subsets: set[tuple[int, ...]] = set()
        for j in ops:
            for p in view.preds[j]:
                prob += self.S[j] >= self.S[p] + self.d(p)
            if not view.succs[j]:
                prob += self.C >= self.S[j] + self.d(j)

        twins = set(self._twins())
        for a, b in twins:
            prob += self.S[a] <= self.S[b]
        self.twins = twins

        forced = 0
        for (a, b), kind in (self.pairs.items() if self.with_pairs else ()):
            m_ab, m_ba = self._big_m(a, b), self._big_m(b, a)
            a_first_impossible = self.head[a] + self.dmin[a] + self.dmin[b] + self.tail[b] > self.ub or (b, a) in twins
            b_first_impossible = self.head[b] + self.dmin[b] + self.dmin[a] + self.tail[a] > self.ub or (a, b) in twins
            if m_ab <= 0 or m_ba <= 0:  # the order is forced by the windows: they never overlap
                forced += 1
                self.y[(a, b)] = 1 if m_ab <= 0 else 0
                self.y[(b, a)] = 1 - self.y[(a, b)]
                continue
            if kind == DISJ:
                if a_first_impossible or b_first_impossible:
                    first, second = (b, a) if a_first_impossible else (a, b)
                    prob += self.S[second] >= self.S[first] + self.d(first)
                    self.y[(first, second)], self.y[(second, first)] = 1, 0
                    forced += 1
                    continue
                z = self.prob.add_variable(f"z_{a}_{b}", cat="Binary")
                self.y[(a, b)] = z
                self.y[(b, a)] = 1 - z
                prob += self.S[b] >= self.S[a] + self.d(a) - m_ab * (1 - z)
                prob += self.S[a] >= self.S[b] + self.d(b) - m_ba * z
            elif kind == SPLIT:
                y_ab = self._order_var(a, b, m_ab, fixed_zero=a_first_impossible)
                y_ba = self._order_var(b, a, m_ba, fixed_zero=b_first_impossible)
                prob += y_ab + y_ba <= 1
                for o in (a, b):
                    if o in self.free_mode:
                        prob += y_ab + y_ba >= self.x[o]
            # CAP pairs get their variables only when a cut needs them.
        self.stats["forced_pairs"] = forced

        # Timeline cut (see bounds.py): C >= sum split_i x_i + T, T >= work / cores, T >= chains.
        compute = [i for i in ops if inst.compute[i]]
        if compute:
            T = self.prob.add_variable("T", lowBound=0)
            split_time = pulp.lpSum(self.s2[i] * self.x[i] for i in compute if i in self.free_mode) + \
                sum(self.s2[i] for i in compute if i in self.fixed_split)

            def single_part(i):
                if i in self.free_mode:
                    return self.s1[i] * (1 - self.x[i])
                return 0.0 if i in self.fixed_split else self.s1[i]

            prob += self.C >= split_time + T
            prob += T >= pulp.lpSum(single_part(i) for i in compute if inst.uses_tc[i]) * (1.0 / inst.num_tc)
            prob += T >= pulp.lpSum(single_part(i) for i in compute if inst.uses_vc[i]) * (1.0 / inst.num_vc)
            cmask = 0
            for i in compute:
                cmask |= 1 << i
            L = {}
            for i in compute:  # topological order
                a = inst.anc[i] & cmask
                covered = 0
                for p in set_bits(a):
                    covered |= inst.anc[p]
                L[i] = self.prob.add_variable(f"L_{i}", lowBound=0)
                prob += L[i] >= single_part(i)
                for p in set_bits(a & ~covered):
                    prob += L[i] >= L[p] + single_part(i)
                if not (inst.desc[i] & cmask):
                    prob += T >= L[i]
            self.T, self.L, self.cmask = T, L, cmask
            self._idle_chain_cuts(compute, split_time, single_part)
            if self.anchored:
                self._anchored_cuts(compute)
                self._partner_args = (compute, split_time, single_part)  # added on demand: add_partner_cuts
        nets = [i for i in ops if inst.net[i]]
        if len(nets) > 1:
            prob += self.C >= min(self.head[i] for i in nets) + sum(self.s1[i] for i in nets) + min(self.tail[i] for i in nets)

    def _idle_chain_cuts(self, compute: list[int], split_time, single_part) -> None:
        """Core time a resource must leave idle along a chain (see the module docstring).

        While op i runs in single mode (or, for a collective, while no split op runs beside it),
        the only other users of resource r that can run are users incomparable with i, and those
        running at one instant pairwise overlap, so they form an antichain: at most W_i of them
        (the width of that set). So at least g_i = num_r - u_i - W_i cores of r idle all along i.
        Ops of a chain run at disjoint times, their idle time is disjoint from every op's busy
        time, so for any chain P:  num_r C >= busy core time + sum_{i in P} g_i d_i,  with busy
        core time = sum split_i x_i num_r + sum single-mode core time. We add it for the heaviest
        chain through each op with g_i > 0 (weights g_i single_i)."""
        inst, view, prob = self.inst, self.view, self.prob
        ops = view.ops
        added = 0
        for cap, uses in ((inst.num_tc, inst.uses_tc), (inst.num_vc, inst.uses_vc)):
            if cap < 1:
                continue
            users = [j for j in compute if uses[j]]
            if not users:
                continue
            weight, term = {}, {}
            for i in ops:
                g = idle_width(inst, i, uses, cap)
                if g <= 0:
                    continue
                weight[i] = g * self.s1[i]
                term[i] = g * (single_part(i) if inst.compute[i] else self.s1[i])
            if not weight:
                continue
            fwd, bwd, via_f, via_b = {}, {}, {}, {}
            for i in ops:
                p = max(view.preds[i], key=lambda q: fwd[q], default=None)
                fwd[i] = weight.get(i, 0.0) + (fwd[p] if p is not None else 0.0)
                via_f[i] = p
            for i in reversed(ops):
                s = max(view.succs[i], key=lambda q: bwd[q], default=None)
                bwd[i] = weight.get(i, 0.0) + (bwd[s] if s is not None else 0.0)
                via_b[i] = s
            chains = set()
            for i in weight:
                chain = []
                k = i
                while k is not None:
                    chain.append(k)
                    k = via_f[k]
                k = via_b[i]
                while k is not None:
                    chain.append(k)
                    k = via_b[k]
                chains.add(frozenset(k for k in chain if k in term))
            busy = pulp.lpSum(single_part(i) for i in users) * (1.0 / cap)
            for chain in chains:
                prob += self.C >= split_time + busy + pulp.lpSum(term[i] for i in sorted(chain)) * (1.0 / cap)
                added += 1
        self.stats["idle_chain_cuts"] = added

    def _partner_idle_cuts(self, compute: list[int], split_time, single_part) -> None:
        """Idle cores along a chain, counting how long the ops beside each op can keep them busy.

        While op i runs in single mode (s1_i long), no op runs split, and the other users of
        resource r busy at any instant are single-mode users unordered with i (the set U_i).
        Partition U_i into chains C_1..C_w (any partition will do): the ops of one chain run one
        after another, so a chain keeps at most one core of r busy, for at most
        min(s1_i, sum_{j in C_c} min(s1_j, s1_i) (1 - x_j)) of i's interval (an op run split cannot
        overlap i). So r has at least  idle_i >= (cap - u_i) s1_i (1 - x_i) - sum_c z_ic  idle core
        time along i, with z_ic at most both terms of that minimum; and, as in `_idle_chain_cuts`,
        idle_i >= g_i s1_i (1 - x_i). Idle times along the ops of a chain of the DAG are disjoint,
        and disjoint from busy core time and from split time, so with I_i the heaviest idle chain
        ending at i, cap C >= cap * split time + single-mode core time + I_i. Unlike the width g_i
        alone, this sees a long op whose only possible partners are short (a long vector op beside
        a few short ones, a GEMM beside one chain of vector ops) or would have to run split.
        Every partition gives a valid cut; `separate_partner_cuts` adds the partitions that bind
        at the relaxation's current modes.
        """
        inst, view, prob = self.inst, self.view, self.prob
        ops = view.ops
        self.partner = {}  # (resource, i) -> (idle variable, need, on, partners, cap)
        added = 0
        for cap, uses, name in ((inst.num_tc, inst.uses_tc, "tc"), (inst.num_vc, inst.uses_vc, "vc")):
            if cap < 1:
                continue
            users = [j for j in compute if uses[j]]
            if not users:
                continue
            idle = {}
            for i in compute:
                if i in self.fixed_split:
                    continue
                need = (cap - int(uses[i])) * self.s1[i]
                if need <= 0:
                    continue
                on = 1 - self.x[i] if i in self.free_mode else 1.0
                partners = [j for j in users if j not in self.fixed_split and inst.unordered(i, j)]
                v = prob.add_variable(f"idle_{name}_{i}", lowBound=0)
                g = idle_width(inst, i, uses, cap)
                if g:
                    prob += v >= g * self.s1[i] * on
                self.partner[(name, i)] = (v, need, on, partners)
                self._add_partner_cover(name, i, None)
                idle[i] = v
            if not idle:
                continue
            acc = {}
            for i in ops:  # topological order
                preds = [acc[p] for p in view.preds[i] if p in acc]
                if i not in idle and len(preds) <= 1:
                    if preds:
                        acc[i] = preds[0]
                    continue
                a = prob.add_variable(f"I_{name}_{i}", lowBound=0)
                for p in preds:
                    prob += a >= p + (idle[i] if i in idle else 0)
                if i in idle:
                    prob += a >= idle[i]
                acc[i] = a
                added += 1
            busy = pulp.lpSum(single_part(i) for i in users)
            for i in ops:
                if not view.succs[i] and i in acc:
                    prob += cap * self.C >= cap * split_time + busy + acc[i]
        self.stats["partner_idle_vars"] = added
        self.stats["partner_covers"] = 0

    def _partner_chains(self, i: int, partners: list[int], xval) -> list[list[int]]:
        """A partition of `partners` into chains, heaviest chain first, weights min(s1_j, s1_i)
        scaled by how single op j is (1 - x_j at `xval`; all ones when None) plus a little of the
        static weight, so that every op is covered and long chains stay together."""
        inst = self.inst
        w = {}
        for j in partners:
            base = min(self.s1[j], self.s1[i])
            single = 1.0
            if xval is not None and j in self.free_mode:
                single = 1.0 - xval.get(j, 0.0)
            w[j] = base * (single + 1e-3)
        left = list(partners)  # topological (block) order
        chains = []
        while left:
            best, prev = {}, {}
            for j in left:
                p = max((q for q in best if (inst.anc[j] >> q) & 1), key=lambda q: best[q], default=None)
                best[j] = w[j] + (best[p] if p is not None else 0.0)
                prev[j] = p
            end = max(best, key=lambda q: best[q])
            chain = []
            while end is not None:
                chain.append(end)
                end = prev[end]
            chain.reverse()
            chains.append(chain)
            taken = set(chain)
            left = [j for j in left if j not in taken]
        return chains

    def _separated(self, i: int, chain: list[int], xval) -> tuple[list[int], float]:
        """Separators of a partner chain of op i, and the most of i's interval the chain can then fill.

        An op k that runs split excludes i. If k is a member of the chain, or lies between two
        consecutive members a, b (a before k before b), then i lies wholly before k or wholly after
        it, so it overlaps ops of one segment of the chain only (k itself, split, not at all). We
        take as separators the members that run split at `xval` and, per gap, one op between that
        does (ops with no single mode here count as split), and return them with the largest
        segment's static capacity min(s1_i, sum_j min(s1_j, s1_i)); with none, ([], s1_i).
        The cut is z <= that + s1_i * sum_k (1 - x_k): where a chosen k runs single it says nothing."""
        inst = self.inst
        if xval is None:
            return [], self.s1[i]

        def split_at(k):
            return k in self.fixed_split or (k in self.free_mode and xval.get(k, 0.0) > 0.5)

        seps, segments, cur = [], [], []
        for t, a in enumerate(chain):
            if split_at(a):
                seps.append(a)
                segments.append(cur)
                cur = []
            else:
                cur.append(a)
            if t + 1 == len(chain):
                break
            b = chain[t + 1]
            for k in set_bits(inst.desc[a] & inst.anc[b] & self.view.mask):
                if k != i and inst.compute[k] and split_at(k):
                    seps.append(k)
                    segments.append(cur)
                    cur = []
                    break
        if not seps:
            return [], self.s1[i]
        segments.append(cur)
        cap = max(min(self.s1[i], sum(min(self.s1[j], self.s1[i]) for j in seg)) for seg in segments)
        return seps, cap

    def add_partner_cuts(self) -> bool:
        """Add the partner-idle cuts (once); False when there are none to add."""
        args = getattr(self, "_partner_args", None)
        if args is None or getattr(self, "partner", None) is not None:
            return False
        self._partner_idle_cuts(*args)
        return bool(getattr(self, "partner", None))

    def _chain_terms(self, name: str, i: int, group: list[int], xval, tag: str):
        """z variables for the chains of `group` (see `_partner_idle_cuts`), a constant for chains of
        ops with a fixed mode, and the group's static capacity (every op single)."""
        prob = self.prob
        terms, static, cap = [], 0.0, 0.0
        for c, chain in enumerate(self._partner_chains(i, group, xval)):
            free = [j for j in chain if j in self.free_mode]
            fixed = sum(min(self.s1[j], self.s1[i]) for j in chain if j not in self.free_mode)
            seps, seg_cap = self._separated(i, chain, xval)
            cap += min(self.s1[i], fixed + sum(min(self.s1[j], self.s1[i]) for j in free))
            if not free and not seps:
                static += min(fixed, self.s1[i])
                continue
            z = prob.add_variable(f"zp_{name}_{i}_{tag}_{c}", lowBound=0, upBound=self.s1[i])
            prob += z <= fixed + pulp.lpSum(min(self.s1[j], self.s1[i]) * (1 - self.x[j]) for j in free)
            if seps:
                prob += z <= seg_cap + self.s1[i] * pulp.lpSum(1 - self.x[q] for q in seps if q in self.free_mode)
            terms.append(z)
        return terms, static, cap

    def _add_partner_cover(self, name: str, i: int, xval, sep: int | None = None) -> None:
        """The partner cut of op i for one chain partition of its partners. With `sep` (an op k
        that may run split, unordered with i): when k runs split, i lies wholly before or wholly
        after it, so partners after k (or, respectively, before k) cannot overlap i. A binary w
        picks the side: sum of z over the chains before k <= cap_before (w + 1 - x_k), after k
        <= cap_after (2 - w - x_k); where k runs single both bounds are slack."""
        v, need, on, partners = self.partner[(name, i)]
        prob = self.prob
        if not hasattr(self, "partner_cuts"):
            self.partner_cuts = []
        tag = str(len(self.partner_cuts))
        self.partner_cuts.append((name, i, sep))
        if sep is None:
            terms, static, _ = self._chain_terms(name, i, partners, xval, tag)
            prob += v >= (need - static) * on - pulp.lpSum(terms)
            return
        inst = self.inst
        before = [j for j in partners if (inst.desc[j] >> sep) & 1]
        after = [j for j in partners if (inst.anc[j] >> sep) & 1]
        rest = [j for j in partners if j not in before and j not in after]
        t_rest, s_rest, _ = self._chain_terms(name, i, rest, xval, tag + "u")
        t_bef, s_bef, c_bef = self._chain_terms(name, i, before, xval, tag + "a")
        t_aft, s_aft, c_aft = self._chain_terms(name, i, after, xval, tag + "d")
        w = prob.add_variable(f"w_{name}_{i}_{tag}", cat="Binary")
        x_k = self.x[sep] if sep in self.free_mode else 1.0
        # A side's chains of fixed-mode ops may overlap i by at most their static capacity, and by
        # nothing when the side is shut: a variable up to it, not the constant (which would force
        # the shut side's capacity to fit in zero and cut off every schedule that runs k split).
        z_bef = prob.add_variable(f"zs_{name}_{i}_{tag}a", lowBound=0, upBound=s_bef)
        z_aft = prob.add_variable(f"zs_{name}_{i}_{tag}d", lowBound=0, upBound=s_aft)
        prob += pulp.lpSum(t_bef) + z_bef <= c_bef * (w + 1 - x_k)
        prob += pulp.lpSum(t_aft) + z_aft <= c_aft * (2 - w - x_k)
        prob += v >= need * on - pulp.lpSum(t_rest) - s_rest - pulp.lpSum(t_bef) - z_bef - pulp.lpSum(t_aft) - z_aft

    def _capacity_at(self, i: int, group: list[int], xval) -> float:
        total = 0.0
        for chain in self._partner_chains(i, group, xval):
            cap_c = sum(min(self.s1[j], self.s1[i]) * (1.0 - xval.get(j, 0.0) if j in self.free_mode else 1.0)
                        for j in chain)
            total += min(cap_c, self.s1[i], self._separated(i, chain, xval)[1])
        return total

    def separate_partner_cuts(self, tol: float = 1e-6) -> int:
        """Add, for each op single in the current solution, the partner cut that the current modes
        make strongest, where it raises the op's idle above its current value: the chain partition
        the current modes make heaviest, or that split at an op k the current solution runs split
        (the side binary of `_add_partner_cover`). Returns how many were added."""
        if not getattr(self, "partner", None):
            return 0
        inst = self.inst
        xval = {j: (var.varValue or 0.0) for j, var in self.x.items()}
        added = 0
        for (name, i), (v, need, on, partners) in self.partner.items():
            on_val = 1.0 - xval[i] if i in self.free_mode else 1.0
            if on_val < 0.5:
                continue
            cur = v.varValue or 0.0
            best, best_sep = need * on_val - self._capacity_at(i, partners, xval), None
            for k in self.view.ops:
                if k == i or not inst.compute[k] or not inst.unordered(i, k):
                    continue
                if not (k in self.fixed_split or (k in self.free_mode and xval.get(k, 0.0) > 0.5)):
                    continue
                before = [j for j in partners if (inst.desc[j] >> k) & 1]
                after = [j for j in partners if (inst.anc[j] >> k) & 1]
                if not before or not after:
                    continue
                rest = [j for j in partners if j not in before and j not in after]
                val = need * on_val - self._capacity_at(i, rest, xval) - max(self._capacity_at(i, before, xval),
                                                                              self._capacity_at(i, after, xval))
                if val > best + tol:
                    best, best_sep = val, k
            if best > cur + tol:
                self._add_partner_cover(name, i, xval, best_sep)
                added += 1
        self.stats["partner_covers"] = self.stats.get("partner_covers", 0) + added
        return added

    def _anchored_cuts(self, compute: list[int]) -> None:
        """The timeline cut anchored at every op j (see the module docstring): the compute ops after
        j run inside [S_j + d_j, C] and those before it inside [0, S_j], each set with its split time
        plus the non-split time its single-mode ops need (work over cores, chains of single ops).
        There are O(ops^2) terms, so each row is built from its coefficients (`_add_ge`)."""
        inst, prob = self.inst, self.prob
        cm = self.cmask

        def extremes(mask: int, rel) -> list[int]:  # the elements of mask not above (rel) another one
            covered = 0
            for k in set_bits(mask):
                covered |= rel[k]
            return list(set_bits(mask & ~covered))

        R = {}  # R_i >= the longest chain of single-mode compute ops starting at i
        for i in reversed(compute):
            R[i] = prob.add_variable(f"R_{i}", lowBound=0)
            terms = {R[i]: 1.0}
            const = self._add_parts(terms, (i,), split=False, scale=-1.0)
            _add_ge(prob, terms, const)
            for s in extremes(inst.desc[i] & cm, inst.desc):
                _add_ge(prob, {**terms, R[s]: -1.0}, const)
        cores = [(inst.num_tc, inst.uses_tc), (inst.num_vc, inst.uses_vc)]
        for j in self.view.ops:
            for mask, rel, chains, after in ((inst.desc[j] & cm, inst.desc, R, True),
                                             (inst.anc[j] & cm, inst.anc, self.L, False)):
                if not mask:
                    continue
                group = list(set_bits(mask))
                t = prob.add_variable(f"{'Tpost' if after else 'Tpre'}_{j}", lowBound=0)
                if after:  # C >= S_j + d_j + split time after j + t
                    terms = {self.C: 1.0, self.S[j]: -1.0}
                    if inst.compute[j]:  # d_j: its single part plus its split part
                        const = self._add_parts(terms, (j,), split=False, scale=-1.0)
                        const += self._add_parts(terms, (j,), split=True, scale=-1.0)
                    else:
                        const = -self.s1[j]
                else:  # S_j >= split time before j + t
                    terms, const = {self.S[j]: 1.0}, 0.0
                const += self._add_parts(terms, group, split=True, scale=-1.0)
                terms[t] = -1.0
                _add_ge(prob, terms, const)
                for k, uses in cores:
                    work = [i for i in group if uses[i]]
                    if k and work:  # t >= single-mode work / cores
                        terms = {t: 1.0}
                        _add_ge(prob, terms, self._add_parts(terms, work, split=False, scale=-1.0 / k))
                for e in extremes(mask, rel):  # minimal descendants / maximal ancestors
                    _add_ge(prob, {t: 1.0, chains[e]: -1.0})

    def _add_parts(self, terms: dict, ops, split: bool, scale: float) -> float:
        """Add `scale` times the split time (`split`) or the single-mode time of `ops` to `terms`
        (variable -> coefficient); return the constant part. Op i takes s2_i x_i and s1_i (1 - x_i)
        where its mode is free, s2_i where it always splits, s1_i where it never does."""
        const = 0.0
        for i in ops:
            if i in self.free_mode:
                coef = self.s2[i] if split else -self.s1[i]
                const += 0.0 if split else scale * self.s1[i]
                x = self.x[i]
                terms[x] = terms.get(x, 0.0) + scale * coef
            elif i in self.fixed_split:
                const += scale * self.s2[i] if split else 0.0
            else:
                const += 0.0 if split else scale * self.s1[i]
        return const

    def _order_var(self, a: int, b: int, m_ab: float, fixed_zero: bool = False):
        if fixed_zero:
            self.y[(a, b)] = 0
            return 0
        v = self.prob.add_variable(f"y_{a}_{b}", cat="Binary")
        self.y[(a, b)] = v
        self.prob += self.S[b] >= self.S[a] + self.d(a) - m_ab * (1 - v)
        return v

    def _pair_var(self, a: int, b: int):
        """y_ab, creating y_ab and y_ba (at most one of them is 1) for a capacity pair on first use."""
        if (a, b) not in self.y:
            m_ab, m_ba = self._big_m(a, b), self._big_m(b, a)
            if m_ab <= 0 or m_ba <= 0:  # the windows force the order: the pair never overlaps
                self.y[(a, b)] = 1 if m_ab <= 0 else 0
                self.y[(b, a)] = 1 if m_ab > 0 else 0
            else:
                ya = self._order_var(a, b, m_ab, fixed_zero=(b, a) in self.twins)
                yb = self._order_var(b, a, m_ba, fixed_zero=(a, b) in self.twins)
                self.prob += ya + yb <= 1
        return self.y[(a, b)]

    def add_capacity_cut(self, group: list[int], cap: int) -> int:
        """Cut up to MAX_CUT_SUBSETS (cap+1)-subsets of `group` not cut before; return how many."""
        added = 0
        for subset in itertools.combinations(sorted(group), cap + 1):
            if added >= MAX_CUT_SUBSETS:
                break
            if subset in self.cut_subsets:
                continue
            self.cut_subsets.add(subset)
            terms = []
            for a, b in itertools.combinations(subset, 2):
                terms.append(self._pair_var(a, b))
                terms.append(self._pair_var(b, a))
            self.prob += pulp.lpSum(terms) >= 1
            added += 1
        self.n_cuts += added
        return added

    def _warm_values(self, start: dict, modes: dict, ub_s: float) -> dict:
        inst, sc = self.inst, self.scale
        vals = {"C": ub_s / sc}
        fin = {}
        for i in self.view.ops:
            vals[f"S_{i}"] = start[i] / sc
            fin[i] = (start[i] + duration(inst, i, modes[i])) / sc
        for i, v in self.x.items():
            vals[v.name] = 1.0 if modes[i] else 0.0
        for (a, b), v in self.y.items():
            if isinstance(v, pulp.LpVariable):
                vals[v.name] = 1.0 if fin[a] <= start[b] / sc + ORDER_TOL else 0.0
        if hasattr(self, "T"):
            single = {i: (0.0 if modes[i] else self.s1[i]) for i in self.view.ops}
            chain = {}
            for i in self.view.ops:
                if not inst.compute[i]:
                    continue
                a = inst.anc[i] & self.cmask
                chain[i] = single[i] + max((chain[p] for p in set_bits(a)), default=0.0)
                vals[f"L_{i}"] = chain[i]
            tc = sum(single[i] for i in chain if inst.uses_tc[i]) / inst.num_tc
            vc = sum(single[i] for i in chain if inst.uses_vc[i]) / inst.num_vc
            vals["T"] = max([tc, vc, *chain.values()])
        return vals

    def before(self) -> list[tuple[int, int]]:
        """Pairs (a, b) the current solution orders a first: binaries at 1 and forced orders."""
        out = []
        for (a, b), v in self.y.items():
            val = v if isinstance(v, (int, float)) else pulp.value(v)
            if val is not None and val > 0.5:
                out.append((a, b))
        return out

    def solution(self) -> tuple[dict, dict]:
        modes = {}
        for i in self.view.ops:
            if i in self.free_mode:
                modes[i] = (self.x[i].varValue or 0.0) > 0.5
            else:
                modes[i] = i in self.fixed_split
        start = {i: (self.S[i].varValue or 0.0) * self.scale for i in self.view.ops}
        return start, modes


def relaxation_bound(inst: Instance, view: BlockView, incumbent, lower_bound: float, solver: str = "highs",
                     time_limit_s: float = 60.0, solution: dict | None = None) -> tuple[float, bool, dict]:
    """Lower bound from the model without any order variable: modes, precedence, the timeline
    cuts and the anchored timeline cuts. Every constraint of it is valid for every schedule no
    longer than the incumbent, so its optimum is a valid bound; it has one binary per op and solves
    in a fraction of the full model's time. (The anchored cuts are left out of the full MIP, where
    their size slows the search more than their strength helps.)
    The partner-idle cuts are separated in up to PARTNER_ROUNDS rounds (each round's optimum is a
    bound, the cuts being valid). Returns (bound in seconds, whether it was solved to optimality,
    stats); `solution`, when given, receives the last round's modes and start times (a hint for a
    schedule, not one: the relaxation ignores core limits)."""
    t0 = time.perf_counter()
    if time_limit_s <= 0:  # a model that could not run proves nothing: do not build it
        return lower_bound, False, {"relaxation_s": 0.0, "relaxation_nodes": 0, "relaxation_bound_s": lower_bound,
                                    "relaxation_rounds": 0, "partner_covers": 0}
    model = BlockModel(inst, view, incumbent, lower_bound, with_pairs=False, anchored=True)
    rounds = 0
    best, best_proven, best_nodes, hint = lower_bound, False, 0, None
    while True:
        left = max(time_limit_s - (time.perf_counter() - t0), 0.0)
        if rounds and left < RELAXATION_ROUND_MIN_S:
            break
        proven, has, dual, nodes = _run_solver(model.prob, solver, left, model.warm)
        rounds += 1
        if dual is not None:  # every round's relaxation is valid, solved to the end or not
            best = max(best, dual * model.scale)
        if not (proven and has):
            break  # a round cut short keeps the last finished round's answer (and its hint)
        best_proven, best_nodes = True, nodes
        hint = model.solution()
        if rounds > PARTNER_ROUNDS or dual * model.scale >= incumbent[0]:
            break
        # The partner cuts join only after a round without them (most blocks close there, and
        # building them costs more than solving), then are separated round by round.
        if not (model.add_partner_cuts() or model.separate_partner_cuts()):
            break
    if solution is not None and hint is not None:
        solution["start"], solution["modes"] = hint
    return best, best_proven, {"relaxation_s": time.perf_counter() - t0, "relaxation_nodes": best_nodes,
                               "relaxation_bound_s": best, "relaxation_rounds": rounds,
                               "partner_covers": model.stats.get("partner_covers", 0)}


def _relaxation_phase(inst: Instance, view: BlockView, incumbent, lower_bound: float, solver: str, deadline: float,
                      quick: bool):
    """The relaxation, and the hunt for a schedule meeting its bound (module docstring). Returns
    (an optimal IlpResult or None, the best incumbent, the relaxation's bound, whether it was solved,
    stats)."""
    t0 = time.perf_counter()
    best_ms, best_start, best_modes = incumbent
    hint: dict = {}
    rb, rb_proven, rstats = relaxation_bound(inst, view, incumbent, lower_bound, solver,
                                             max(min(deadline - t0, RELAXATION_MAX_S), 0.0), hint)
    target = rb * (1.0 + RELAXATION_REL_TOL)

    def done(proof: str, bound: float):
        stats = dict(rstats, proof=proof, rounds=0, capacity_cuts=0, nodes=0, binaries=0)
        return (IlpResult(best_ms, min(bound, best_ms), "optimal", best_start, best_modes, stats),
                (best_ms, best_start, best_modes), rb, rb_proven, rstats)

    if rb_proven and best_ms > target and hint:
        # The relaxation is often exact where the incumbent is not (the optimum pairs vector ops
        # that the list schedule runs split), so look for a schedule that meets its bound: the
        # serial and parallel schemes in its modes and order, then the decision-point search on
        # the block restricted to the relaxation's split GEMMs (ops using TCs that it runs split
        # stay split, every other op may take either mode). Both only produce legal schedules;
        # optimality still comes from the bound alone.
        ms, start, modes = schedule_from_hint(inst, view, hint["start"], hint["modes"], target)
        rstats["hint_makespan_s"] = ms
        if ms < best_ms:
            best_ms, best_start, best_modes = ms, start, modes
        if best_ms > target and len(view.ops) <= SEARCH_MAX_OPS:
            ensure_warm()
        left = deadline - time.perf_counter()
        if best_ms > target and len(view.ops) <= SEARCH_MAX_OPS and left > 0:
            restrict = {i: (True if hint["modes"][i] and inst.uses_tc[i] else None) for i in view.ops}
            found = search_block(inst, view, (best_ms, best_start, best_modes),
                                 time.perf_counter() + min(left, HINT_SEARCH_S), modes=restrict, target=target)
            rstats["hint_search"] = dict(found.stats, makespan_s=found.makespan)
            if found.makespan < best_ms:
                best_ms, best_start, best_modes = found.makespan, found.start, found.modes
    if rb_proven and best_ms <= target:
        return done("relaxation", rb)
    if len(view.ops) <= SEARCH_MAX_OPS:
        ensure_warm()
    left = deadline - time.perf_counter()
    if quick and len(view.ops) <= SEARCH_MAX_OPS and left > 0:
        # With an incumbent this close to the bound, the exact search often finishes in
        # milliseconds where the MIP needs seconds (a gap of rounding size: which one-cycle op
        # sits beside which); a search that finishes proves its schedule optimal.
        found = search_block(inst, view, (best_ms, best_start, best_modes),
                             time.perf_counter() + min(left, QUICK_SEARCH_S))
        rstats["quick_search"] = found.stats
        if found.makespan < best_ms:
            best_ms, best_start, best_modes = found.makespan, found.start, found.modes
        if found.complete:
            return done("search", best_ms)
    left = deadline - time.perf_counter()
    if rb_proven and hint and left > 0 and best_ms > target and len(view.ops) <= SEARCH_MAX_OPS:
        # The incumbent and the relaxation often differ in a few ops' modes only (which vector
        # ops pair up to host a one-cycle op): search with every other op held to the
        # incumbent's mode. Again a heuristic; only the bound proves.
        near = {i: (None if bool(hint["modes"][i]) != bool(best_modes[i]) else bool(best_modes[i]))
                for i in view.ops}
        found = search_block(inst, view, (best_ms, best_start, best_modes),
                             time.perf_counter() + min(left, HINT_SEARCH_S), modes=near, target=target)
        rstats["near_search"] = dict(found.stats, makespan_s=found.makespan)
        if found.makespan < best_ms:
            best_ms, best_start, best_modes = found.makespan, found.start, found.modes
        if best_ms <= target:
            return done("relaxation", rb)
    return None, (best_ms, best_start, best_modes), rb, rb_proven, rstats


def solve_block(inst: Instance, view: BlockView, incumbent, lower_bound: float, solver: str = "highs",
                time_limit_s: float = 60.0, phase_s: float | None = None, deadline: float | None = None,
                quick_search: bool = True) -> IlpResult:
    """Prove the incumbent optimal or find the optimum of one block (see the module docstring).

    The relaxation phases get `phase_s` and then the MIP `time_limit_s` (without `phase_s`, both
    share `time_limit_s`); nothing runs past the absolute `deadline`. `quick_search=False` skips the
    short unrestricted search of the first phase, for a caller that has just run a longer one from
    this incumbent."""
    t0 = time.perf_counter()
    phase_end = t0 + (phase_s if phase_s is not None else time_limit_s)
    if deadline is not None:
        phase_end = min(phase_end, deadline)
    rb, rb_proven, rstats = lower_bound, False, {}
    for attempt in range(HINT_ROUNDS):
        start_ms = incumbent[0]
        closed, incumbent, bound, proven, stats = _relaxation_phase(inst, view, incumbent, lower_bound, solver,
                                                                    phase_end, quick=quick_search and attempt == 0)
        rb = max(rb, bound)
        rb_proven = rb_proven or proven
        rstats = stats if attempt == 0 else dict(rstats, **{f"again_{attempt}": stats})
        if closed is not None:
            closed.stats.update(rstats, build_solve_s=time.perf_counter() - t0)
            closed.lower_bound = min(max(closed.lower_bound, rb), closed.makespan)
            return closed
        if (incumbent[0] >= start_ms or time.perf_counter() >= phase_end
                or not (proven and incumbent[0] <= bound * (1.0 + HINT_RETRY_GAP))):
            # Again only with a better incumbent (a relaxation at a lower UB sees other modes), and
            # only when the bound is near: far from it, the MIP and the search do better.
            break
    best_ms, best_start, best_modes = incumbent
    mip_end = (time.perf_counter() + time_limit_s) if phase_s is not None else t0 + time_limit_s
    if deadline is not None:
        mip_end = min(mip_end, deadline)
    lower_bound = max(lower_bound, rb)
    if mip_end <= time.perf_counter():
        # No time is left for the MIP, so it would be built and never run (on a block of 100+ ops
        # its pair constraints take longer to build than the relaxation took to solve): report the
        # best schedule with the proven bound, unproven.
        stats = dict(rstats, proof="none", rounds=0, capacity_cuts=0, nodes=0, binaries=0,
                     build_solve_s=time.perf_counter() - t0)
        return IlpResult(best_ms, min(lower_bound, best_ms), "time_limit", best_start, best_modes, stats)
    model = BlockModel(inst, view, incumbent, lower_bound)
    model.stats.update(rstats)
    bound = lower_bound
    status = "time_limit"
    rounds = 0
    nodes = 0
    tol_s = (ORDER_TOL if solver == "highs" else CBC_ORDER_TOL) * model.scale
    while True:
        rounds += 1
        left = mip_end - time.perf_counter()
        if left <= 0:
            break
        proven, has, dual, n_nodes = _run_solver(model.prob, solver, left, model.warm)
        nodes += max(n_nodes, 0)
        if dual is not None:  # every round solves a relaxation, so its bound holds for the block
            bound = max(bound, dual * model.scale)
        if not has:
            if proven:  # "optimal" without a solution cannot happen; treat as a solver failure
                status = "error"
            break
        approx_start, modes = model.solution()
        start = realise(inst, view, modes, approx_start, model.interacting, tol_s, model.before())
        violations = capacity_violations(inst, view, start, modes, 1e-10 * best_ms)
        if violations:
            added = sum(model.add_capacity_cut(group, inst.num_tc if resource == "tc" else inst.num_vc)
                        for resource, group in violations)
            if not added:
                # Cannot happen: a cut subset has an order binary at 1, which realise() keeps, so
                # it never runs pairwise overlapping again. Stop rather than loop on a bug.
                status = "error"
                break
            continue
        ms = max(start[i] + duration(inst, i, modes[i]) for i in view.ops)
        if ms < best_ms:
            best_ms, best_start, best_modes = ms, start, modes
        if proven:
            status = "optimal"
        break
    bound = min(bound, best_ms)
    if status == "optimal" and best_ms > bound * (1.0 + PROVEN_REL_GAP):
        status = "time_limit"  # the solver's claim does not survive exact realisation
    stats = dict(model.stats, proof="full", rounds=rounds, capacity_cuts=model.n_cuts, nodes=nodes,
                 build_solve_s=time.perf_counter() - t0)
    stats["binaries"] = len(model.x) + sum(1 for v in model.y.values() if isinstance(v, pulp.LpVariable))
    return IlpResult(best_ms, bound, status, best_start, best_modes, stats)
