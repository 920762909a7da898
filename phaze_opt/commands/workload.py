"""`phaze-opt workload`: the model's size, training FLOPs and per-layer graph summary."""

from __future__ import annotations

import time

from . import add_mbs, check_mbs

HELP = "summarise a model's workload graph: parameters, training FLOPs, per-layer memory and op counts"
DESCRIPTION = (
    "Build the model's layers on the meta device at one TP width and microbatch, trace their forward "
    "and backward passes, and print the whole model's parameters and training FLOPs per sequence, and "
    "for every layer its per-device parameters, stashed activation bytes and op counts by unit."
)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model name (presets/models, or --configs DIR) or path to a model YAML")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel width (default 1)")
    add_mbs(parser)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--attention", choices=("unfused", "flash"), default=None,
                        help="attention kernels: unfused (default: the model's choice) or flash (one fused op per pass)")
    parser.add_argument("--no-cache", action="store_true", help="extract again instead of using the disk cache")


def run(args) -> dict:
    from ..configs import positive_arg
    from ..workload.graphs import active_params, build_layer_graph, mtp_params
    from ..workload.models import LIMITS, load_model, model_features

    start = time.perf_counter()
    model = load_model(args.model)
    mbs = check_mbs(args)
    if args.seq is not None:
        positive_arg(args.seq, "--seq", LIMITS["seq"])
    graph = build_layer_graph(model, args.tp, mbs, args.seq, cache=not args.no_cache,
                              attention=args.attention)
    elapsed = time.perf_counter() - start
    layers = []
    for layer in graph.layers:
        ops = graph.op_graphs[layer.kind]
        layers.append({
            "name": layer.name,
            "kind": layer.kind,
            "params": layer.params,
            "param_bytes": layer.param_bytes,
            "activation_bytes": layer.activation_bytes,
            "boundary_bytes": layer.boundary_bytes,
            "input_bytes": layer.input_bytes,
            "fwd_flops": layer.fwd_flops,
            "bwd_flops": layer.bwd_flops,
            "fwd_ops": ops["fwd"].count_by_unit(),
            "bwd_ops": ops["bwd"].count_by_unit(),
            # bytes kept per microbatch by recompute mode (none/selective/full), each also with
            # sequence parallelism over the TP group ("+sp"); see Layer.activation_bytes_for
            "activation_bytes_by_mode": layer.activation_bytes_by_mode(),
            "attention_core_bytes": layer.attention_core_bytes,
            "sequence_parallel_bytes": layer.sequence_parallel_bytes,
            "checkpoint_bytes": layer.checkpoint_bytes(False),
            "checkpoint_bytes_sp": layer.checkpoint_bytes(True),
        })
    return {
        "model": model.name,
        "family": model.family,
        "tp": graph.tp,
        "attention": args.attention or model.attention,
        "mbs": graph.mbs,
        "seq": graph.seq,
        "params": graph.total_params,
        # parameters one token meets: all but the routed experts it is not sent to (= params when dense)
        "active_params": active_params(model),
        # multi-token-prediction modules' own parameters, outside `params` as published sizes count
        "mtp_params": mtp_params(model),
        "experts": model.experts,
        "top_k": model.top_k,
        "features": model_features(model),
        "train_flops_per_sequence": graph.train_flops_per_sequence,
        "distinct_layer_kinds": graph.kinds,
        "params_note": "params per layer are per device at this TP width; 'params' at the top is the whole model",
        "layers": layers,
        "unmapped_ops": graph.extra.get("unmapped_ops", []),
        "source": graph.extra.get("source", "traced"),
        "time_s": elapsed,
    }


def _si(x: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def _counts(c: dict) -> str:
    return " ".join(f"{unit}:{n}" for unit, n in sorted(c.items()))


def render(r: dict) -> str:
    lines = [
        f"model {r['model']} ({r['family']}), TP {r['tp']}, microbatch {r['mbs']}, sequence {r['seq']}, "
        f"{r['attention']} attention",
        f"  parameters (whole model):     {r['params']:,} ({r['params'] / 1e9:.3f} B)"
        + (f", {r['active_params'] / 1e9:.3f} B active ({r['experts']} experts, top-{r['top_k']})" if r["experts"] else ""),
        f"  training FLOPs per sequence:  {_si(r['train_flops_per_sequence'], 'FLOP')} (fwd + bwd, no recompute)",
        *([f"  architecture:                 {', '.join(r['features'])}"] if r.get("features") else []),
        *([f"  MTP modules' own parameters:  {r['mtp_params']:,}"] if r.get("mtp_params") else []),
        f"  distinct layer kinds:         {', '.join(r['distinct_layer_kinds'])}",
        "",
        f"  {'layers':<18} {'params/device':>15} {'activations':>14} {'selective+SP':>14} {'fwd+bwd FLOP':>16}  ops fwd | bwd",
    ]
    rows, i = r["layers"], 0
    while i < len(rows):  # identical consecutive layers print once
        j = i
        while j + 1 < len(rows) and rows[j + 1]["kind"] == rows[i]["kind"]:
            j += 1
        row = rows[i]
        label = row["name"] if i == j else f"{row['name']}..{rows[j]['name'].rsplit('.', 1)[-1]} (x{j - i + 1})"
        lines.append(
            f"  {label:<18} {row['params']:>15,} {_mib(row['activation_bytes']):>14} "
            f"{_mib(row['activation_bytes_by_mode']['selective+sp']):>14} "
            f"{_si(row['fwd_flops'] + row['bwd_flops'], 'FLOP'):>16}  {_counts(row['fwd_ops'])} | {_counts(row['bwd_ops'])}"
        )
        i = j + 1
    if r["unmapped_ops"]:
        lines.append(f"  ops without a cost rule (costed as vector ops): {', '.join(r['unmapped_ops'])}")
    lines.append(f"  time: {r['time_s']:.2f} s (graphs: {r['source']})")
    return "\n".join(lines)
