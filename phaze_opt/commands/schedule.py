"""`phaze-opt schedule`: the proven-optimal operator schedule of every distinct layer and pass."""

from __future__ import annotations

from . import add_mbs, check_mbs

HELP = "schedule every distinct layer's forward and backward operators on a chip (exact ILP)"
DESCRIPTION = (
    "Trace the model at one TP width and microbatch, estimate every operator's latency on the chip, "
    "and solve each distinct layer pass's schedule to proven optimality (status 'optimal' only when "
    "proven). Shows makespan, lower bound, solve time, per-op start/mode/cores and TC/VC utilisation."
)


def add_arguments(p):
    p.add_argument("--model", required=True, help="model config name or path to a YAML file")
    p.add_argument("--arch", default="tpuv4", help="architecture config name or path (default tpuv4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel width (default 1)")
    add_mbs(p)
    p.add_argument("--system", default="default", help="system config whose TP link the all-reduces use")
    p.add_argument("--solver", choices=("highs", "cbc"), default="highs", help="MILP solver (default highs)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per layer pass (default 60)")


def run(args) -> dict:
    # Imported here so that the other subcommands start without torch.
    from ..errors import PhazeError
    from ..hardware.arch import load_arch
    from ..hardware.latency import estimate
    from ..solve.schedule.solver import core_utilisation, problem_from_graph, solve_schedule
    from ..system import load_system
    from ..workload.graphs import build_layer_graph
    from ..workload.models import load_model

    model = load_model(args.model)
    if args.tp not in model.tp_widths:
        raise PhazeError(f"--tp {args.tp}: not a TP width of {model.name}; allowed: {', '.join(map(str, model.tp_widths))}")
    arch = load_arch(args.arch)
    link = load_system(args.system).tp_link(args.tp)
    graph = build_layer_graph(model, args.tp, check_mbs(args))
    rows = []
    for kind in graph.kinds:
        for pass_name in ("fwd", "bwd"):
            og = graph.op_graphs[kind][pass_name]
            lat = estimate(og, [arch], interconnect=link)
            problem = problem_from_graph(og, lat.single[0], lat.split[0], arch.num_tc, arch.num_vc)
            s = solve_schedule(problem, solver=args.solver, time_limit_s=args.time_limit)
            util = core_utilisation(problem, s.split, s.duration, s.makespan)
            ops = [
                {
                    "name": op.name,
                    "unit": op.unit,
                    "start_s": s.start[i],
                    "duration_s": s.duration[i],
                    "mode": "split" if s.split[i] else ("single" if op.unit in ("tc", "vc", "tc+vc") else op.unit),
                    "cores": list(s.cores[i]),
                }
                for i, op in enumerate(og.ops)
            ]
            rows.append(
                {
                    "layer": kind,
                    "pass": pass_name,
                    "makespan_s": s.makespan,
                    "lower_bound_s": s.lower_bound,
                    "status": s.status,
                    "method": s.method,
                    "solve_s": s.solve_s,
                    "tc_utilisation": util["tc"],
                    "vc_utilisation": util["vc"],
                    "ops": ops,
                }
            )
    return {"model": model.name, "arch": arch.name or args.arch, "tp": args.tp, "mbs": args.mbs, "schedules": rows}


def render(r: dict) -> str:
    lines = [f"{r['model']} on {r['arch']}, TP {r['tp']}, microbatch {r['mbs']}"]
    lines.append(f"{'layer':10s} {'pass':4s} {'makespan':>12s} {'lower bound':>12s} {'status':9s} {'method':7s} "
                 f"{'solve':>8s} {'TC util':>8s} {'VC util':>8s} {'ops':>4s} {'split':>5s}")
    for s in r["schedules"]:
        n_split = sum(op["mode"] == "split" for op in s["ops"])
        lines.append(
            f"{s['layer']:10s} {s['pass']:4s} {s['makespan_s'] * 1e3:9.3f} ms {s['lower_bound_s'] * 1e3:9.3f} ms "
            f"{s['status']:9s} {s['method']:7s} {s['solve_s']:7.3f}s {s['tc_utilisation'] * 100:7.1f}% "
            f"{s['vc_utilisation'] * 100:7.1f}% {len(s['ops']):4d} {n_split:5d}"
        )
    return "\n".join(lines)


def heartbeat(args) -> str:
    """The label of the line `phaze-opt` prints every 10 s while the layer schedules are solved."""
    return f"schedule {args.model} on {args.arch}"
