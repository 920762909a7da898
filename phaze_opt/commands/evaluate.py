"""`phaze-opt evaluate`: one design end to end (graphs -> latencies -> ILP -> placement DP)."""

from __future__ import annotations

import os

from ..training import add_recipe_arguments, describe
from . import add_ilp_time_limit, add_mbs, check_mbs

# What runs when neither the flag nor the model's file names a chip or a system (models.DEFAULT_FIELDS).
GENERIC_ARCH = "tpuv4"
GENERIC_SYSTEM = "default"
# The most processes --jobs takes by default: each holds torch and a model's graphs (~0.5 GB), and a
# 405B-class model has 30 widths to trace at most, so more cores than this add memory, not speed.
DEFAULT_JOBS_MAX = 8

HELP = "evaluate one design (architecture, microbatch, recompute) with its optimal or a given placement"
DESCRIPTION = (
    "Run workload graphs -> per-operator latencies -> exact per-layer schedules -> exact placement DP "
    "for one design and report throughput, MFU, the placement and the per-layer cost table."
)


def add_arguments(p):
    p.add_argument("--model", default="gpt3-175b", help="model config name or path to a YAML file (default gpt3-175b)")
    p.add_argument("--arch", default=None,
                   help=f"architecture config name or path (default: the model's default_arch, else {GENERIC_ARCH})")
    add_mbs(p)
    # Every recipe field, from its declaration (training.py): flag, choices, default and help.
    add_recipe_arguments(p, skip=("mbs",))
    p.add_argument("--system", default=None,
                   help=f"system config name or path (default: the model's default_system, else {GENERIC_SYSTEM})")
    p.add_argument("--devices", type=int, default=None, metavar="N", help="override the system's accelerator count")
    p.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="override the system's global batch (sequences per optimizer step)")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="override the model's sequence length (tokens per sequence)")
    add_ilp_time_limit(p)
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that trace and schedule a 10^10+-parameter model's TP widths side by side when "
                        f"they are not cached (default: this machine's cores, at most {DEFAULT_JOBS_MAX}; 1 for none)")


def default_jobs() -> int:
    """The cores this process may run on, at most DEFAULT_JOBS_MAX."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        cores = os.cpu_count() or 1
    return max(1, min(cores, DEFAULT_JOBS_MAX))


def run(args) -> dict:
    # Imported here so that `phaze-opt --help` and the other subcommands start without torch.
    from dataclasses import replace

    from ..design.evaluate import design_evaluator
    from ..errors import PhazeError
    from ..hardware.arch import load_arch
    from ..system import load_system
    from ..training import recipe_from_args

    from ..workload.models import load_model

    if args.jobs is not None and args.jobs < 1:
        raise PhazeError(f"--jobs must be a positive number of processes, got {args.jobs}")
    model = load_model(args.model)
    # Each of chip, system and ILP limit: the flag, else the model's default, else the command's.
    arch_name, arch_from = _choose(args.arch, model.default_arch, GENERIC_ARCH)
    system_name, system_from = _choose(args.system, model.default_system, GENERIC_SYSTEM)
    ilp_limit, ilp_from = _choose(args.ilp_time_limit, model.default_ilp_time_limit or None, None)
    arch = load_arch(arch_name)
    system = load_system(system_name)
    for flag, field, value in (("--devices", "accelerators", args.devices), ("--global-batch", "global_batch", args.global_batch)):
        if value is not None:
            if value < 1:
                raise PhazeError(f"{flag} must be a positive integer, got {value}")
            system = replace(system, **{field: value})
    recipe = recipe_from_args(args, mbs=check_mbs(args))
    if args.seq is not None:
        from ..configs import positive_arg
        from ..workload.models import LIMITS

        positive_arg(args.seq, "--seq", LIMITS["seq"])
        if model.position == "learned" and args.seq > model.positions:
            raise PhazeError(f"--seq {args.seq}: {model.name} has {model.positions} learned positions")
        model = replace(model, seq=args.seq)
    evaluate = design_evaluator(ilp_limit, args.jobs or default_jobs())
    result = evaluate(model, arch, recipe, system).to_json()
    result["arch"] = arch.name or arch_name
    result["system"] = system.name or system_name
    result["chosen_by"] = {"arch": arch_from, "system": system_from, "ilp_time_limit": ilp_from}
    result["ilp_time_limit_s"] = evaluate.ilp_time_limit_s
    if not result["feasible"] and "command" in (arch_from, system_from):
        result["hint"] = _generic_defaults_hint(model.name, arch_from, system_from)
    spec = recipe.recipe()
    spec["placement_spec"] = spec.pop("placement")
    result.update(spec)
    result["seq"] = args.seq
    result["devices"] = system.accelerators
    result["global_batch"] = system.global_batch
    used = (result.get("placement") or {}).get("devices_used")
    if result.get("feasible") and used:
        result["idle_devices"] = max(system.accelerators - used, 0)
    stages = result.get("placement", {}).get("stages", [])
    if stages:
        worst = max(stages, key=lambda s: s["memory_bytes"])
        result["memory_per_device"] = dict(worst.get("memory_split", {}), total=worst["memory_bytes"],
                                           headroom=worst["headroom_bytes"], stage=worst["index"])
    return result


def _choose(flag, model_default, generic):
    """(value, who chose it): the flag, else the model file's default, else the command's."""
    if flag is not None:
        return flag, "flag"
    if model_default:
        return model_default, "model"
    return generic, "command"


def _generic_defaults_hint(model: str, arch_from: str, system_from: str) -> str:
    """What to pass when the command's generic chip or system (chosen for no model) does not fit:
    the shipped chip with the most HBM and the shipped systems, by name."""
    from .. import configs
    from ..hardware.arch import load_arch

    archs = configs.available("archs")
    roomiest = max(archs, key=lambda a: load_arch(a).hbm_bytes)
    generic = [f"--{flag} {name}" for flag, name, who in (("arch", GENERIC_ARCH, arch_from),
                                                          ("system", GENERIC_SYSTEM, system_from)) if who == "command"]
    return (f"{' and '.join(generic)} are the command's generic defaults and {model}'s file names no "
            f"default_arch/default_system; pass --arch and --system for a chip and system it fits, e.g. "
            f"--arch {roomiest} (the most HBM of the shipped chips, {load_arch(roomiest).hbm_bytes / 2**30:.0f} GiB) "
            f"with one of the systems {', '.join(configs.available('systems'))}")


def _chosen_by_model(r: dict, what: str) -> str:
    return " (the model's default)" if (r.get("chosen_by") or {}).get(what) == "model" else ""


def render(r: dict) -> str:
    # the recipe's non-default fields as the declaration words them (training.describe); the placement
    # and microbatch have lines of their own
    extras = describe({k: v for k, v in r.items() if k not in ("mbs", "placement")}, always=("recompute",))
    if r.get("seq"):
        extras.append(f"sequence {r['seq']}")
    head = f"{r['model']} on {r['arch']}  mbs {r['mbs']}  {', '.join(extras)}  area {r['area_mm2']:.1f} mm^2"
    if r.get("system"):
        head += (f"\nchip {r['arch']}{_chosen_by_model(r, 'arch')}, system {r['system']}{_chosen_by_model(r, 'system')}"
                 f": {r['devices']} devices, global batch {r['global_batch']}")
        if _chosen_by_model(r, "ilp_time_limit"):
            head += f", ILP time limit {r['ilp_time_limit_s']:g} s per layer pass (the model's default)"
    mem = r.get("memory_per_device")
    if mem:
        gib = 2.0**30
        head += (f"\nmemory per device (fullest stage {mem['stage']}): parameters {mem.get('parameters', 0) / gib:.2f}, "
                 f"gradients {mem.get('gradients', 0) / gib:.2f}, optimizer state {mem.get('optimizer_state', 0) / gib:.2f}, "
                 + "".join(f"{words} {mem[key] / gib:.2f}, " for key, words in (
                     ("low_precision_weights", "low-precision weight copies"),
                     ("gathered_weights", "gathered weights held forward to backward")) if key in mem) +
                 f"activations {mem.get('activations', 0) / gib:.2f}, recompute working set "
                 f"{mem.get('recompute_working_set', 0) / gib:.2f}; total {mem['total'] / gib:.2f} GiB, "
                 f"headroom {mem['headroom'] / gib:.2f} GiB")
    if r.get("note"):
        head += f"\nnote: {r['note']}"
    t = r["timings"]
    work = f"graph {t['graph_s']:.3f} s, estimate {t['estimate_s']:.3f} s, ILP {t['ilp_s']:.3f} s, DP {t['dp_s'] * 1e3:.1f} ms"
    if not r["feasible"]:
        hint = f"\nhint: {r['hint']}" if r.get("hint") else ""
        return f"{head}\ninfeasible: {r['reason']}{hint}\n({work})"
    p = r["placement"]
    lines = [
        head,
        f"placement: TP {p['tp']} x PP {p['pp']} x DP {p['dp']}"
        + (f" (EP {p['ep']})" if p.get("ep", 1) > 1 else "") + (f" x CP {p['cp']}" if p.get("cp", 1) > 1 else "")
        + f", {p['microbatches']} microbatches per pipeline, "
        f"bubble {p.get('bubble_fraction', 0) * 100:.1f}%",
        f"throughput {r['throughput']:.2f} sequences/s ({r['tokens_per_s']:.3e} tokens/s), "
        f"{r['time_per_batch_s']:.3f} s per batch, MFU {r['mfu']:.1%}",
        "stages (layers, memory per device, HBM headroom):",
    ]
    if r.get("proven", True) and r.get("unproven"):
        lines.insert(3, f"proven: the layer passes left open ({', '.join(r['unproven'])}) cannot change this "
                        f"throughput (the placement on their proven lower bounds reaches the same)")
    if not r.get("proven", True):
        lines.insert(3, f"NOT proven optimal: layer schedules hit the ILP time limit ({', '.join(r['unproven'])}); "
                        f"the throughput above is reached by verified schedules, the proven bound is "
                        f"{r['throughput_bound']:.6g} sequences/s (+{(r['throughput_bound'] / r['throughput'] - 1) * 100:.3g}%)")
    idle = idle_devices_line(r)
    if idle:
        lines.insert(3, idle)
    for s in p["stages"]:
        lines.append(
            f"  {s['index']:3d}  {s['first_layer']} .. {s['last_layer']}  ({len(s['layers'])} layers)  "
            f"{s['memory_bytes'] / 2**30:7.2f} GiB  headroom {s['headroom_bytes'] / 2**30:7.2f} GiB"
        )
    lines.append(f"({work})")
    return "\n".join(lines)


def idle_devices_line(r: dict) -> str:
    """One line when the placement leaves some of the system's devices idle: how many, and why (the
    throughput above is that of the devices used, which a reader would otherwise take for the system's)."""
    idle, p = r.get("idle_devices") or 0, r["placement"]
    if idle <= 0:
        return ""
    used = p["devices_used"]
    shape = f"tp {p['tp']}" + (f" x cp {p['cp']}" if p.get("cp", 1) > 1 else "") + f" x pp {p['pp']} x dp {p['dp']}"
    spec = r.get("placement_spec") or "optimal"
    if spec == "optimal" or r.get("note"):  # the DP's choice (also standing in for a missing expert placement)
        why = "the optimal placement: none using more devices is faster"
    elif spec == "expert":
        why = "the model config's expert placement"
    else:
        why = "the placement given; --placement optimal, or a larger dp, uses more"
    return f"idle devices: {idle} of the system's {r['devices']} ({used} used, {shape}: {why})"


def heartbeat(args) -> str:
    """The label of the line `phaze-opt` prints every 10 s while this runs (a large model takes minutes)."""
    return f"evaluate {args.model}" + (f" on {args.arch}" if args.arch else "")
