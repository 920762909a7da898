"""`phaze-opt measure`: time the project's own transformer block on a real device (per-layer truth)."""

from __future__ import annotations

import json
from pathlib import Path

from ..configs import positive_arg
from ..system import MBS_LIMIT
from ..validation.suites import LAYER_KERNELS

HELP = "time the traced transformer block's TP shard on a real GPU (or the CPU): per-layer truth as JSON"
DESCRIPTION = (
    "Materialise the model's transformer block (the same torch module the workload graphs are traced from, "
    "its TP shard: heads/tp and ffn/tp, compute only, no collectives) with random weights on a device, and "
    "time its forward and its forward+backward (warm-up, then the median of --repeats; CUDA graphs and "
    "CUDA events on a GPU). Writes the JSON form of presets/validation/truth/h100-blocks.json, which a "
    "layer_seconds validation suite reads as its data."
)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="model name (presets/models, or --configs DIR) or path to a model YAML")
    p.add_argument("--tp", type=int, nargs="+", default=[1], metavar="T",
                   help="tensor-parallel width(s) of the shard; several make a grid (default 1)")
    p.add_argument("--mbs", type=int, nargs="+", default=[1], metavar="B",
                   help="microbatch size(s) in sequences; several make a grid (default 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to run (default cuda)")
    p.add_argument("--attention", choices=("unfused", "flash"), nargs="+", default=None,
                   help="attention kernel(s): unfused (the traced graphs' default) and/or flash (PyTorch SDPA); "
                        "default: the model config's")
    p.add_argument("--kernels", choices=LAYER_KERNELS, nargs="+", default=[LAYER_KERNELS[0]],
                   help="how the block's kernels run: eager (one PyTorch kernel per operator, default) and/or "
                        "inductor (torch.compile fuses the element-wise work, a stand-in for a fusing stack)")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="timed runs per pass; the median is kept (default 10)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed runs first (default 3)")
    p.add_argument("--gemms", action="store_true",
                   help="also time plain GEMMs of the block's linear-layer shapes (M tokens, N, K), as the "
                        "truth file's gemm entries")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="time eager launches (as the shipped H100 truth was) instead of CUDA graph replays")
    p.add_argument("--out", default=None, metavar="FILE", help="write the measurements to this JSON file")


def run(args) -> dict:
    # Imported here so that `phaze-opt --help` and the other subcommands start without torch.
    from ..cache import write_atomic
    from ..errors import PhazeError
    from ..validation.measure import measure, truth_json
    from ..workload.models import load_model

    model = load_model(args.model)
    mbs = [positive_arg(value, "--mbs", MBS_LIMIT) for value in args.mbs]
    path = Path(args.out) if args.out else None
    if path is not None and path.is_dir():
        raise PhazeError(f"measure: --out {args.out}: is a folder; give a file name")
    result = measure(model, args.tp, mbs, device=args.device, attentions=args.attention or [None],
                     repeats=args.repeats, warmup=args.warmup, gemms=args.gemms, cuda_graphs=not args.no_cuda_graphs,
                     kernels=args.kernels)
    if path is not None:
        if not write_atomic(path, json.dumps(truth_json(result), indent=1) + "\n"):
            raise PhazeError(f"measure: --out {args.out}: cannot write the file")
        result["out"] = str(path)
    return result


def render(r: dict) -> str:
    lines = [f"device {r['device']}, torch {r['torch']}, {r['dtype']}, timing: {r['timing']} "
             f"(median of {r['repeats']} after {r['warmup']} warm-up)"]
    lines.append(f"  {'model':<14} {'tp':>3} {'mbs':>4} {'attention':>9} {'fwd ms':>9} {'bwd ms':>9} "
                 f"{'fwd+bwd ms':>11} {'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12} kernels")
    for row, s in zip(r["layers"], r["summary"]):
        lines.append(f"  {row['model']:<14} {row['tp']:>3} {row['mbs']:>4} {'flash' if row['flash'] else 'unfused':>9} "
                     f"{row['fwd_s'] * 1e3:>9.3f} {row['bwd_s'] * 1e3:>9.3f} {row['fwd_bwd_s'] * 1e3:>11.3f} "
                     f"{s['fwd_tflops']:>12.3g} {s['bwd_tflops']:>12.3g} {row.get('kernels', 'eager')}")
    for g in r["gemm"]:
        lines.append(f"  gemm M {g['M']} N {g['N']} K {g['K']}: {g['s'] * 1e3:.3f} ms, {g['tflops']:.3g} TFLOP/s")
    for s in r["skipped"]:
        what = f"gemm {s['gemm']}" if "gemm" in s else f"{s['model']} tp {s['tp']} mbs {s['mbs']}"
        lines.append(f"  skipped {what}: {s['reason']}")
    lines.append("  TFLOP/s: the traced graph's FLOPs of the pass over its median time; compute only, no collectives")
    if "out" in r:
        lines.append(f"  wrote {r['out']} (the data of a layer_seconds validation suite)")
    return "\n".join(lines)


def heartbeat(args) -> str:
    """The label of the line `phaze-opt` prints every 10 s while blocks are timed (minutes on a CPU)."""
    return f"measure {args.model} on {args.device}"
