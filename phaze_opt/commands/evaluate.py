"""`phaze-opt evaluate`: one design end to end (graphs -> latencies -> ILP -> placement DP)."""

from __future__ import annotations

from . import add_ilp_time_limit

HELP = "evaluate one design (architecture, microbatch, recompute) with its optimal or a given placement"
DESCRIPTION = (
    "Run workload graphs -> per-operator latencies -> exact per-layer schedules -> exact placement DP "
    "for one design and report throughput, MFU, the placement and the per-layer cost table."
)


def add_arguments(p):
    p.add_argument("--model", default="gpt3-175b", help="model config name or path to a YAML file (default gpt3-175b)")
    p.add_argument("--arch", default="tpuv4", help="architecture config name or path (default tpuv4)")
    p.add_argument("--mbs", type=int, default=1, help="microbatch size in sequences (default 1)")
    p.add_argument("--recompute", action="store_true", help="recompute activations instead of stashing them")
    p.add_argument("--system", default="default", help="system config name or path (default: default)")
    p.add_argument(
        "--placement",
        default="optimal",
        help="optimal (the DP), expert (the model config's), or tp=T,pp=P,dp=D (layers split evenly)",
    )
    add_ilp_time_limit(p)


def run(args) -> dict:
    # Imported here so that `phaze-opt --help` and the other subcommands start without torch.
    from ..configs import positive_arg
    from ..hardware.arch import load_arch
    from ..search.evaluate import design_evaluator
    from ..system import MBS_LIMIT

    positive_arg(args.mbs, "--mbs", MBS_LIMIT)
    arch = load_arch(args.arch)
    evaluate = design_evaluator(args.ilp_time_limit)
    result = evaluate(args.model, arch, args.mbs, args.recompute, args.system, args.placement).to_json()
    result["arch"] = arch.name or args.arch
    result["mbs"] = args.mbs
    result["recompute"] = bool(args.recompute)
    return result


def render(r: dict) -> str:
    head = f"{r['model']} on {r['arch']}  mbs {r['mbs']}  recompute {'on' if r['recompute'] else 'off'}  area {r['area_mm2']:.1f} mm^2"
    t = r["timings"]
    work = f"graph {t['graph_s']:.3f} s, estimate {t['estimate_s']:.3f} s, ILP {t['ilp_s']:.3f} s, DP {t['dp_s'] * 1e3:.1f} ms"
    if not r["feasible"]:
        return f"{head}\ninfeasible: {r['reason']}\n({work})"
    p = r["placement"]
    lines = [
        head,
        f"placement: TP {p['tp']} x PP {p['pp']} x DP {p['dp']}, {p['microbatches']} microbatches per pipeline, "
        f"bubble {p.get('bubble_fraction', 0) * 100:.1f}%",
        f"throughput {r['throughput']:.2f} sequences/s ({r['tokens_per_s']:.3e} tokens/s), "
        f"{r['time_per_batch_s']:.3f} s per batch, MFU {r['mfu'] * 100:.1f}%",
        "stages (layers, memory per device, HBM headroom):",
    ]
    if r.get("proven", True) and r.get("unproven"):
        lines.insert(3, f"proven: the layer passes left open ({', '.join(r['unproven'])}) cannot change this "
                        f"throughput (the placement on their proven lower bounds reaches the same)")
    if not r.get("proven", True):
        lines.insert(3, f"NOT proven optimal: layer schedules hit the ILP time limit ({', '.join(r['unproven'])}); "
                        f"the throughput above is reached by verified schedules, the proven bound is "
                        f"{r['throughput_bound']:.6g} sequences/s (+{(r['throughput_bound'] / r['throughput'] - 1) * 100:.3g}%)")
    for s in p["stages"]:
        lines.append(
            f"  {s['index']:3d}  {s['first_layer']} .. {s['last_layer']}  ({len(s['layers'])} layers)  "
            f"{s['memory_bytes'] / 2**30:7.2f} GiB  headroom {s['headroom_bytes'] / 2**30:7.2f} GiB"
        )
    lines.append(f"({work})")
    return "\n".join(lines)
