"""Speed of the per-operator latency model: all ops of one GPT-3 175B layer, forward and backward,
on 1,000 designs of the phaze space (target: under 1 s).

    python benchmarks/bench_latency.py [--designs 1000] [--repeats 7]

Uses the workload's traced graph (`build_layer_graph(load_model("gpt3-175b"), tp=1, mbs=1)`) when it
is available, otherwise an equivalent hand-built op list (say which in the output).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phaze_opt.hardware.latency import DesignArrays, estimate  # noqa: E402
from phaze_opt.design.space import load_space  # noqa: E402
from phaze_opt.workload.ops import NONE, TC, TCVC, VC, Op, OpGraph  # noqa: E402

E = 2  # bytes per element


def _gemm(name, b, m, k, n, unit=TC, vector_ops=()):
    return Op(name, "gemm" if b == 1 else "bgemm", unit, flops=2.0 * b * m * k * n,
              bytes_read=E * b * (m * k + k * n), bytes_written=E * b * m * n, gemm=(b, m, k, n),
              elements=b * m * n, vector_ops=tuple(vector_ops))


def _vec(name, kind, elements, vector_ops, inputs=1):
    return Op(name, kind, VC, flops=float(elements * len(vector_ops)), bytes_read=E * elements * inputs,
              bytes_written=E * elements, elements=elements, vector_ops=tuple(vector_ops))


def _chain(layer, pass_name, ops):
    return OpGraph(layer, pass_name, tuple(ops), tuple((i, i + 1) for i in range(len(ops) - 1)))


def hand_built_gpt3_layer(mbs=1, seq=2048, hidden=12288, heads=96):
    """A GPT-3 decoder layer (tp=1) by hand: the GEMMs with their dgrad/wgrad, and the vector ops."""
    t, h, a, dh, f = mbs * seq, hidden, heads, hidden // heads, 4 * hidden
    fwd = [
        _vec("ln1", "norm", t * h, ["layernorm"]),
        _gemm("qkv", 1, t, h, 3 * h, TCVC, ["add"]),
        Op("split_heads", "noop", NONE),
        _gemm("scores", a * mbs, seq, dh, seq),
        _vec("scale_mask_softmax", "softmax", a * mbs * seq * seq, ["scale", "masked_fill", "softmax"]),
        _vec("attn_dropout", "dropout", a * mbs * seq * seq, ["dropout"]),
        _gemm("context", a * mbs, seq, seq, dh),
        _gemm("proj", 1, t, h, h, TCVC, ["add"]),
        _vec("dropout_residual1", "elementwise", t * h, ["dropout", "add"], inputs=2),
        _vec("ln2", "norm", t * h, ["layernorm"]),
        _gemm("fc1_gelu", 1, t, h, f, TCVC, ["add", "gelu"]),
        _gemm("fc2", 1, t, f, h, TCVC, ["add"]),
        _vec("dropout_residual2", "elementwise", t * h, ["dropout", "add"], inputs=2),
    ]
    bwd = [
        _vec("dropout_residual2_bwd", "elementwise", t * h, ["dropout_backward"], inputs=2),
        _gemm("fc2_dgrad", 1, t, h, f), _gemm("fc2_wgrad", 1, f, t, h),
        _vec("gelu_bwd", "activation", t * f, ["gelu_backward"], inputs=2),
        _gemm("fc1_dgrad", 1, t, f, h), _gemm("fc1_wgrad", 1, h, t, f),
        _vec("ln2_bwd", "norm", t * h, ["layernorm_backward"], inputs=3),
        _vec("dropout_residual1_bwd", "elementwise", t * h, ["dropout_backward", "add"], inputs=2),
        _gemm("proj_dgrad", 1, t, h, h), _gemm("proj_wgrad", 1, h, t, h),
        _gemm("context_dgrad_probs", a * mbs, seq, dh, seq), _gemm("context_dgrad_v", a * mbs, seq, seq, dh),
        _vec("attn_dropout_bwd", "dropout", a * mbs * seq * seq, ["dropout_backward"], inputs=2),
        _vec("softmax_bwd", "softmax", a * mbs * seq * seq, ["softmax_backward", "scale"], inputs=2),
        _gemm("scores_dgrad_q", a * mbs, seq, seq, dh), _gemm("scores_dgrad_k", a * mbs, seq, seq, dh),
        Op("merge_heads", "noop", NONE),
        _gemm("qkv_dgrad", 1, t, 3 * h, h), _gemm("qkv_wgrad", 1, h, t, 3 * h),
        _vec("ln1_bwd", "norm", t * h, ["layernorm_backward"], inputs=3),
        _vec("residual_grad_add", "elementwise", t * h, ["add"], inputs=2),
    ]
    return _chain("decoder", "fwd", fwd), _chain("decoder", "bwd", bwd)


def gpt3_layer_graphs():
    try:
        from phaze_opt.workload.graphs import build_layer_graph
        from phaze_opt.workload.models import load_model

        lg = build_layer_graph(load_model("gpt3-175b"), tp=1, mbs=1)
        kind = max(lg.kinds, key=lambda k: lg.op_graphs[k]["fwd"].flops)  # the decoder layer
        return lg.op_graphs[kind]["fwd"], lg.op_graphs[kind]["bwd"], f"traced ({kind})"
    except Exception as exc:  # the workload module may not be there yet
        fwd, bwd = hand_built_gpt3_layer()
        return fwd, bwd, f"hand-built (traced graph unavailable: {type(exc).__name__}: {exc})"


def sample_designs(n: int, seed: int = 0):
    space = load_space("phaze")
    rng = random.Random(seed)
    archs = space.architectures(order="grid")
    designs = []
    for arch in rng.sample(archs, n):
        point = {k: v for k, v in arch.items() if k != "area_mm2"}
        point.update(hbm_gib=rng.choice(space.params["hbm_gib"]), mbs=1, recompute=False)
        designs.append(space.accelerator(point))
    return designs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    fwd, bwd, source = gpt3_layer_graphs()
    designs = sample_designs(args.designs)
    n_ops = len(fwd.ops) + len(bwd.ops)

    def once_from_accelerators():
        estimate(fwd, designs)
        estimate(bwd, designs)

    arrays = DesignArrays.from_accelerators(designs)

    def once_from_arrays():
        estimate(fwd, arrays)
        estimate(bwd, arrays)

    for label, fn in (("from Accelerator objects", once_from_accelerators), ("from DesignArrays", once_from_arrays)):
        fn()  # warm up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"latency estimate, GPT-3 layer fwd+bwd ({n_ops} ops, {source}), {args.designs} designs, {label}: "
              f"median {statistics.median(times) * 1e3:.1f} ms over {args.repeats} runs "
              f"(min {min(times) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
