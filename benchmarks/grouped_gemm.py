"""Grouped GEMMs by tokens per expert: the latency template against DeepGEMM's published H800
kernel times (presets/validation/truth/deepgemm-h800-fp8-2025.json), and the routed experts' time
of the shipped MoE models at each EP width (design/parallel.py, "Tokens per expert under EP").

    python benchmarks/grouped_gemm.py

Nothing is fitted: every published row is held out. The chip is h100-sxm less its per-operator
launch gap, since DeepGEMM times kernels alone.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from phaze_opt.design.parallel import ep_widths, expert_capacity_of, expert_pass_s
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import estimate
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.models import load_model
from phaze_opt.workload.ops import Op, OpGraph

TRUTH = Path(__file__).resolve().parents[1] / "phaze_opt/presets/validation/truth/deepgemm-h800-fp8-2025.json"
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "mixtral-8x7b", "deepseek-v3")


def published_rows():
    data = json.loads(TRUTH.read_text())
    return [dict(r, layout="dense", groups=1) for r in data["dense"]] + data["grouped"]


def template_errors(chip):
    rows = published_rows()
    ops = tuple(Op("mm", "gemm", "tc", flops=2.0 * r["groups"] * r["M"] * r["K"] * r["N"],
                   bytes_read=r["groups"] * (r["M"] * r["K"] + r["K"] * r["N"]), bytes_written=2 * r["groups"] * r["M"] * r["N"],
                   gemm=(r["groups"], r["M"], r["K"], r["N"]), datatype="fp8") for r in rows)
    seconds = estimate(OpGraph("gemms", "fwd", ops, ()), [chip]).split[0]
    for r, t in zip(rows, seconds):
        r["model_tflops"] = 2.0 * r["groups"] * r["M"] * r["K"] * r["N"] / t / 1e12
        r["error"] = r["tflops"] / r["model_tflops"] - 1.0  # model time against published time
    return rows


def main() -> None:
    shipped = load_arch("h100-sxm")
    chip = dataclasses.replace(shipped, efficiency=dataclasses.replace(shipped.efficiency, op_overhead_s=0.0))
    rows = template_errors(chip)
    print("| layout | groups | M per group | N | K | published TFLOP/s | template TFLOP/s | template time error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['groups']} | {r['M']} | {r['N']} | {r['K']} | {r['tflops']} | "
              f"{r['model_tflops']:.0f} | {r['error'] * 100:+.0f}% |")
    for layout in ("dense", "contiguous", "masked"):
        errs = [abs(r["error"]) for r in rows if r["layout"] == layout]
        print(f"{layout}: mean |error| {statistics.mean(errs) * 100:.1f}%, max {max(errs) * 100:.1f}% ({len(errs)} rows)")
    print()
    print("| model (TP 1, MBS 1, BF16) | tokens per expert at EP 1 | experts fwd + bwd, ms, by EP width |")
    print("|---|---|---|")
    for name in MODELS:
        model = load_model(name)
        graph = build_layer_graph(model, 1, 1, model.seq)
        kind = next(k for k in graph.kinds if expert_capacity_of(graph.op_graphs[k]["fwd"]))
        fwd, bwd = graph.op_graphs[kind]["fwd"], graph.op_graphs[kind]["bwd"]
        slots = expert_capacity_of(fwd)
        times = [(e, sum(float(expert_pass_s(og, slots, e, [shipped], None)[0]) for og in (fwd, bwd)))
                 for e in ep_widths(model)]
        print(f"| {name} | {slots} | " + ", ".join(f"EP {e}: {t * 1e3:.2f}" for e, t in times) + " |")


if __name__ == "__main__":
    main()
