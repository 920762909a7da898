"""`phaze-opt evaluate`: one design end to end (graphs -> latencies -> ILP -> placement DP)."""

from __future__ import annotations

import argparse

from ..training import CP_COMMS, EXPERT_WEIGHTS, MOE_DISPATCHERS, OPTIMIZER_STATES, PRECISIONS, RECOMPUTE_MODULES, STACKS, ZERO_STAGES
from . import add_ilp_time_limit, add_mbs, check_mbs

# What runs when neither the flag nor the model's file names a chip or a system (models.DEFAULT_FIELDS).
GENERIC_ARCH = "tpuv4"
GENERIC_SYSTEM = "default"

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
    p.add_argument("--recompute", nargs="?", const="full", default="none", choices=("none", "selective", "full"),
                   help="activation recompute: none, selective (the attention core) or full (each layer's "
                        "forward from its checkpointed input); a bare --recompute is full")
    p.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help=f"with --recompute selective: the modules recomputed (Megatron-Core --recompute-modules), "
                        f"any of {', '.join(RECOMPUTE_MODULES)} (default: core_attn, the attention core)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism: norm and dropout regions sharded over the TP group")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="interleaved 1F1B with V model chunks per pipeline device (default 1)")
    for part in ("embedding", "loss"):
        p.add_argument(f"--account-for-{part}", action="store_true",
                       help=f"count the {part} as a layer in the pipeline split (Megatron-Core "
                            f"--account-for-{part}-in-pipeline-split; lets interleaving split more layer counts)")
    p.add_argument("--optimizer-state", choices=tuple(OPTIMIZER_STATES), default=None,
                   help="optimizer-state layout beyond weight and gradient: fp32-adam (12 B/param), bf16-moments "
                        "(fp32 master + BF16 moments, 8 B) or bf16-adamw (BF16 moments, no master, 4 B); "
                        "default: the system's own accounting")
    p.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                   help="optimizer sharding over data parallelism: 0, 1 (distributed optimizer), 2 (gradients "
                        "sharded too, weights whole: FSDP without resharding after forward) or 3 (FSDP)")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the data-parallel gradient reduction with the backward pass")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="with --zero 1 or 2: the weights' all-gather under the next iteration's forward")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="with --sequence-parallel: TP reduce-scatters/all-gathers pipelined with the GEMMs")
    p.add_argument("--overlap-p2p-comm", action=argparse.BooleanOptionalAction, default=None,
                   help="with --virtual-stages > 1: the pipeline sends and receives beside compute, but in the "
                        "schedule's warm-up and flush (default: the stack's, on under megatron-te)")
    p.add_argument("--attention", choices=("unfused", "flash"), default=None,
                   help="attention kernel (default: the model config's)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="number format of the transformer blocks' linear-layer GEMMs (Transformer Engine): bf16, "
                        "fp8 (per-tensor delayed scaling), mxfp8 or nvfp4 (block scaled); the arch's tensor cores "
                        "must support it (tc_datatypes), else the design is infeasible (default bf16)")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="with --precision fp8 or mxfp8: parameters held in that format, no BF16 weight "
                        "(Megatron-Core --fp8-param-gather); the weight all-gather moves 1-byte weights")
    p.add_argument("--stack", choices=STACKS, default=STACKS[0],
                   help="the software stack's kernel fusion: megatron-lm (pointwise chains fused), eager (one kernel "
                        "per PyTorch operator) or megatron-te (Transformer Engine: norms, RoPE and FP8 casts fused "
                        "too) (default megatron-lm)")
    p.add_argument("--system", default=None,
                   help=f"system config name or path (default: the model's default_system, else {GENERIC_SYSTEM})")
    p.add_argument("--devices", type=int, default=None, metavar="N", help="override the system's accelerator count")
    p.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="override the system's global batch (sequences per optimizer step)")
    p.add_argument(
        "--placement",
        default="optimal",
        help="optimal (the DP), expert (the model config's), or tp=T,pp=P,dp=D[,ep=E,cp=C] (layers split "
             "evenly; ep: expert parallelism, dividing dp, or with --expert-tensor-parallel ep x ETP dividing "
             "tp x cp x dp; cp: context parallelism)",
    )
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="override the model's sequence length (tokens per sequence)")
    p.add_argument("--capacity-factor", type=float, default=1.0, metavar="F",
                   help="MoE expert buffers hold F x the mean tokens per expert (default 1.0)")
    p.add_argument("--load-imbalance", type=float, default=1.0, metavar="I",
                   help="MoE: tokens at the busiest expert-parallel rank over the mean, >= 1 (default 1.0, balanced)")
    p.add_argument("--expert-tensor-parallel", type=int, default=None, metavar="ETP",
                   help="MoE parallel folding (Megatron-Core --expert-tensor-parallel-size): the MoE layers' own TP "
                        "width; EP then spans TP x CP x DP ranks (ep x ETP divides tp x cp x dp); default: unfolded, "
                        "expert TP = tp and ep dividing dp")
    p.add_argument("--moe-dispatcher", choices=MOE_DISPATCHERS, default=MOE_DISPATCHERS[0],
                   help="MoE token dispatcher: alltoall (every token copy to its expert's rank) or deepep "
                        "(Megatron-Core flex + DeepEP: each token once per destination node over the inter-node "
                        "network, then NVLink) (default alltoall)")
    p.add_argument("--moe-a2a-overlap", action="store_true",
                   help="Megatron-Core --overlap-moe-expert-parallel-comm: the EP all-to-alls of one microbatch "
                        "under the compute of another in the steady 1F1B phase (needs virtual stages when pp > 1; "
                        "not with full recompute)")
    p.add_argument("--cp-comm", choices=CP_COMMS, default=CP_COMMS[0],
                   help="how context parallelism moves K and V (Megatron-Core --cp-comm-type): p2p (ring attention, "
                        "each K/V hop under one block's attention) or all_gather (K/V all-gathered before the "
                        "attention, dK/dV reduce-scattered after it, exposed; Llama 3's CP) (default p2p)")
    p.add_argument("--expert-weights", choices=EXPERT_WEIGHTS, default=None,
                   help="where MoE layers apply the router's weights: combine (each expert output scaled as it "
                        "is added back; Megatron-Core before 0.13) or activation (the expert MLP scales its "
                        "activation's output; Megatron-Core 0.13 on) (default: the stack's, activation under "
                        "megatron-te)")
    add_ilp_time_limit(p)


def run(args) -> dict:
    # Imported here so that `phaze-opt --help` and the other subcommands start without torch.
    from dataclasses import replace

    from ..design.evaluate import design_evaluator
    from ..errors import PhazeError
    from ..hardware.arch import load_arch
    from ..system import load_system
    from ..training import Training

    from ..workload.models import load_model

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
    recipe = Training(mbs=check_mbs(args), recompute=args.recompute, placement=args.placement,
                      sequence_parallel=args.sequence_parallel, virtual_stages=args.virtual_stages, zero=args.zero,
                      overlap_grad_reduce=args.overlap_grad_reduce, attention=args.attention,
                      overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                      capacity_factor=args.capacity_factor, load_imbalance=args.load_imbalance,
                      account_for_embedding=args.account_for_embedding, account_for_loss=args.account_for_loss,
                      optimizer_state=args.optimizer_state, precision=args.precision,
                      expert_tensor_parallel=args.expert_tensor_parallel, stack=args.stack,
                      fp8_param_gather=args.fp8_param_gather,
                      moe_dispatcher=args.moe_dispatcher, moe_a2a_overlap=args.moe_a2a_overlap,
                      recompute_modules=args.recompute_modules, cp_comm=args.cp_comm,
                      expert_weights=args.expert_weights, overlap_p2p_comm=args.overlap_p2p_comm)
    if args.seq is not None:
        from ..configs import positive_arg
        from ..workload.models import LIMITS

        positive_arg(args.seq, "--seq", LIMITS["seq"])
        if model.position == "learned" and args.seq > model.positions:
            raise PhazeError(f"--seq {args.seq}: {model.name} has {model.positions} learned positions")
        model = replace(model, seq=args.seq)
    evaluate = design_evaluator(ilp_limit)
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
    extras = [f"recompute {r['recompute']}"]
    if r.get("sequence_parallel"):
        extras.append("sequence parallel")
    if r.get("virtual_stages", 1) > 1:
        extras.append(f"{r['virtual_stages']} virtual stages")
    counted = [name for name in ("embedding", "loss") if r.get(f"account_for_{name}")]
    if counted:
        extras.append(f"{' and '.join(counted)} counted in the pipeline split")
    if r.get("optimizer_state"):
        extras.append(f"{r['optimizer_state']} optimizer state")
    if r.get("precision"):
        extras.append(f"{r['precision'].upper()} GEMMs")
    if r.get("zero"):
        extras.append(f"ZeRO-{r['zero']}")
    if r.get("overlap_grad_reduce"):
        extras.append("overlapped grad reduce")
    if r.get("overlap_param_gather"):
        extras.append("overlapped param gather")
    if r.get("tp_comm_overlap"):
        extras.append("TP comm overlapped")
    if r.get("overlap_p2p_comm") is not None:
        extras.append(f"pipeline p2p {'overlapped' if r['overlap_p2p_comm'] else 'exposed'}")
    if r.get("fp8_param_gather"):
        extras.append("low-precision parameters")
    if r.get("expert_tensor_parallel"):
        extras.append(f"experts folded at expert TP {r['expert_tensor_parallel']}")
    if r.get("moe_dispatcher"):
        extras.append(f"{r['moe_dispatcher']} dispatcher")
    if r.get("moe_a2a_overlap"):
        extras.append("EP all-to-all overlapped")
    if r.get("cp_comm"):
        extras.append(f"{r['cp_comm']} context parallelism")
    if r.get("expert_weights"):
        extras.append(f"expert weights at the {r['expert_weights']}")
    if r.get("stack"):
        extras.append(f"{r['stack']} kernels")
    if r.get("attention"):
        extras.append(f"{r['attention']} attention")
    if r.get("seq"):
        extras.append(f"sequence {r['seq']}")
    if r.get("capacity_factor", 1.0) != 1.0:
        extras.append(f"capacity factor {r['capacity_factor']:g}")
    if r.get("load_imbalance", 1.0) != 1.0:
        extras.append(f"load imbalance {r['load_imbalance']:g}")
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
                 + (f"low-precision weight copies {mem['low_precision_weights'] / gib:.2f}, "
                    if "low_precision_weights" in mem else "") +
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
