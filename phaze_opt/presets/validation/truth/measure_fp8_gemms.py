"""The device run behind truth/h100-fp8-gemms-2026.json: BF16 and FP8 (E4M3, per-tensor scales, as
Transformer Engine's delayed/current scaling feeds cuBLASLt) GEMM throughput on one GPU, for the
linear-layer shapes of the 2024-26 blocks (M tokens = sequence x microbatch, N, K of each TP shard).
`torch._scaled_mm` is PyTorch's entry to cuBLASLt's FP8 GEMM (the kernel TE calls); BF16 is `torch.mm`.
CUDA events, median of 20 after 5 warm-ups. Usage: python3 measure_fp8_gemms.py OUT.json
"""
import json
import statistics
import sys

import torch

SHAPES = [  # (M, N, K): Llama-3 8B TP 1 and 70B TP 8 linear layers at 8192 tokens, and Llama-3 405B TP 8
    (8192, 6144, 4096), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
    (8192, 1280, 8192), (8192, 8192, 1024), (8192, 7168, 8192), (8192, 8192, 3584),
    (8192, 2304, 16384), (8192, 16384, 2048), (8192, 13312, 16384), (8192, 16384, 6656),
]


def timed(fn, warmup=5, repeats=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main(out):
    rows = []
    one = torch.ones((), device="cuda")
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        bf16 = timed(lambda: torch.mm(a, b))
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # cuBLASLt FP8 wants the second operand column-major
        fp8 = timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        flop = 2 * m * n * k
        rows.append({"M": m, "N": n, "K": k, "bf16_s": bf16, "fp8_s": fp8,
                     "bf16_tflops": flop / bf16 / 1e12, "fp8_tflops": flop / fp8 / 1e12})
        print(f"M {m} N {n} K {k}: bf16 {flop / bf16 / 1e12:.0f} TFLOP/s, fp8 {flop / fp8 / 1e12:.0f} TFLOP/s, "
              f"x{bf16 / fp8:.2f}", flush=True)
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": "cuda-events, median of 20",
            "fp8": "e4m3fn, per-tensor scale 1, bf16 output (torch._scaled_mm -> cuBLASLt)", "gemm": rows}
    with open(out, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
