"""Unit tests of the ILP layer: the bounds the solver wrappers report, and realisation."""

from __future__ import annotations

import pulp
import pytest

from phaze_opt.solve.schedule.ilp import QUIET_OPTIONS, _run_solver, quiet_highs, realise, relaxation_bound
from phaze_opt.solve.schedule.instance import block_view, prepare
from phaze_opt.solve.schedule.types import ScheduleProblem


def _lp() -> pulp.LpProblem:
    prob = pulp.LpProblem("lp", pulp.LpMinimize)
    c = prob.add_variable("C", lowBound=0)
    s = prob.add_variable("S", lowBound=0)
    prob += c
    prob += s >= 3
    prob += c >= s + 4
    return prob


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_proven_lp_reports_its_optimum_as_bound(solver):
    # HiGHS reports mip_dual_bound = 0 (finite) for a model without integer variables, so a
    # wrapper that read it would call 0 the bound of a proven optimum of 7.
    proven, has, bound, _ = _run_solver(_lp(), solver, 10.0, {})
    assert proven and has
    assert bound == pytest.approx(7.0)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_proven_mip_reports_its_optimum_as_bound(solver):
    prob = _lp()
    x = prob.add_variable("x", cat="Binary")
    c = next(v for v in prob.variables() if v.name == "C")
    prob += c >= 9.5 - 2 * x
    prob += c >= 1 + 7 * x
    proven, has, bound, _ = _run_solver(prob, solver, 10.0, {})
    assert proven and has
    assert bound == pytest.approx(8.0)  # x = 1: max(7, 7.5, 8) = 8; x = 0: 9.5


def test_a_real_solve_prints_nothing(capfd):
    """No banner ("Running HiGHS 1.16.0 ... Copyright") or log from the solver libraries, read at the
    file descriptors, where HiGHS's C++ writes. highspy 1.16 writes its banner while its constructor
    runs, before PuLP's msg=False takes effect; the check holds for any highspy the project allows
    (the lock's 1.15.1 wrote nothing even before)."""
    import highspy

    capfd.readouterr()
    for solver in ("highs", "cbc"):
        prob = _lp()
        x = prob.add_variable("x", cat="Binary")
        c = next(v for v in prob.variables() if v.name == "C")
        prob += c >= 9.5 - 2 * x
        assert _run_solver(prob, solver, 10.0, {"C": 9.5, "S": 3.0, "x": 0.0})[0]
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (highspy.__file__, out, err)


def test_the_quiet_highs_has_its_log_off():
    highs = quiet_highs()
    for key, value in QUIET_OPTIONS.items():
        got = highs.getOptionValue(key)  # (status, value) in the highspy versions checked
        assert (got[-1] if isinstance(got, tuple) else got) == value


def test_relaxation_bound_of_a_model_without_binaries():
    # One TC, nothing can split: the relaxation is a pure LP whose optimum (TC work 2 + 3) is the bound.
    p = ScheduleProblem(units=("tc", "tc", "vc"), single=(2.0, 3.0, 1.0), split=(2.0, 3.0, 1.0),
                        edges=((0, 2),), num_tc=1, num_vc=1)
    inst = prepare(p)
    assert len(inst.blocks) == 1
    view = block_view(inst, inst.blocks[0])
    incumbent = (5.0, {0: 0.0, 1: 2.0, 2: 2.0}, {0: False, 1: False, 2: False})
    bound, proven, _ = relaxation_bound(inst, view, incumbent, 0.0)
    assert proven
    assert bound == pytest.approx(5.0)


def test_realise_keeps_orders_from_binaries_despite_rounded_times():
    # The solver put op 0 before op 1 (binary at 1) but its start times, read back rounded, show a
    # tiny overlap. The order must come from the binary: op 1 starts when op 0 ends.
    p = ScheduleProblem(units=("tc", "tc"), single=(1.0, 1.0), split=(0.5, 0.5), edges=(), num_tc=2, num_vc=1)
    inst = prepare(p)
    view = block_view(inst, inst.blocks[0])
    modes = {0: True, 1: False}
    approx = {0: 0.0, 1: 0.5 - 3e-6}
    start = realise(inst, view, modes, approx, [(0, 1)], tol=1e-9)
    assert start[1] == 0.0  # from times alone the pair reads as overlapping: a split op overlapped
    start = realise(inst, view, modes, approx, [(0, 1)], tol=1e-9, before=[(0, 1)])
    assert start == {0: 0.0, 1: 0.5}


# Found by a random search: the idle-chain cut raises the order-free relaxation to the optimum
# (the oracle's) where the timeline and anchored cuts alone stop lower (25 vs 27, 12 vs 13). In the
# first, the TC is the only core and nothing may run beside the collectives on the chain 0 -> 1/4
# -> 5 -> 6 except ops that depend on them; in the second, three TCs but at most one TC op can run
# beside op 2 or op 3.
IDLE_CHAIN_CASES = [
    (ScheduleProblem(units=("net", "tc", "vc", "net", "tc", "tc", "net"), single=(8.0, 2.0, 8.0, 2.0, 8.0, 3.0, 6.0),
                     split=(2.0, 1.0, 8.0, 2.0, 2.0, 1.0, 3.0),
                     edges=((0, 1), (0, 3), (0, 4), (0, 6), (1, 3), (1, 5), (2, 3), (4, 5), (5, 6)), num_tc=1, num_vc=1),
     27.0, 25.0),
    (ScheduleProblem(units=("tc", "net", "tc", "tc", "net", "vc", "vc"), single=(3.0, 3.0, 6.0, 3.0, 1.0, 6.0, 1.0),
                     split=(3.0, 1.0, 3.0, 3.0, 1.0, 3.0, 1.0),
                     edges=((0, 5), (0, 6), (1, 5), (2, 5), (2, 6), (3, 4), (4, 5)), num_tc=3, num_vc=1),
     13.0, 12.0),
]


@pytest.mark.parametrize("p, optimum, without_cut", IDLE_CHAIN_CASES)
def test_idle_chain_cut_lifts_the_relaxation_to_the_optimum(p, optimum, without_cut, monkeypatch):
    from schedule_oracle import oracle_makespan

    from phaze_opt.solve.schedule.bounds import block_lower_bound
    from phaze_opt.solve.schedule.heuristic import list_schedule
    from phaze_opt.solve.schedule.ilp import BlockModel

    assert oracle_makespan(p.units, p.single, p.split, p.edges, p.num_tc, p.num_vc) == pytest.approx(optimum)
    inst = prepare(p)
    assert len(inst.blocks) == 1
    view = block_view(inst, inst.blocks[0])
    incumbent = list_schedule(inst, view)
    lb = block_lower_bound(inst, view)
    assert lb <= optimum + 1e-9
    bound, proven, _ = relaxation_bound(inst, view, incumbent, lb)
    assert proven and bound == pytest.approx(optimum)
    monkeypatch.setattr(BlockModel, "_idle_chain_cuts", lambda *args: None)
    # The partner-idle cuts count the same forced idle (their width term g_i) and more, so they
    # go too: without both, the relaxation stops lower.
    monkeypatch.setattr(BlockModel, "_partner_idle_cuts", lambda *args: None)
    from phaze_opt.solve.schedule import bounds
    monkeypatch.setattr(bounds, "idle_chain_bound", lambda *args: 0.0)
    bound, proven, _ = relaxation_bound(inst, view, incumbent, block_lower_bound(inst, view))
    assert proven and bound == pytest.approx(without_cut)
