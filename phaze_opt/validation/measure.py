"""Per-layer truth on the user's own device: the project's traced block, materialised and timed.

The op graphs every cost model reads are traced from `workload.layers.TransformerBlock` on the meta
device. To check those models against real hardware the same module is built here with real (random)
weights on a real device and its forward and backward passes are timed, so that what is measured is
what is modelled: the same TP shard (heads/t and ffn/t columns), the same layout and the same operators.
Two things differ from the traced module, both on purpose and both in `device_kernels`:

- compute only: Megatron's `f` and `g` (`workload.collectives`) are identities, so no all-reduce (or the
  copy that stands for one off the meta device) is timed; the truth file measured the shard the same way
  (configs/validation/truth/README.md);
- fused attention runs PyTorch's `scaled_dot_product_attention` (FlashAttention kernels on CUDA) where
  the traced graph has its one `phaze::flash_attention` node per pass. The project's reference
  implementation of that node (layers.py) writes the s x s scores to memory and would time unfused
  attention under a fused label. Grouped KV heads are repeated to the query heads first, as the truth
  file's script did, so that every SDPA backend applies.

Timing follows configs/validation/truth/measure_blocks.py: `fwd_s` is the forward pass with autograd
recording, `fwd_bwd_s` the forward then `backward` of a random output gradient, `bwd_s` their
difference; warm-up runs, then the median of `repeats`. On CUDA each pass is captured once in a CUDA
graph and replayed (no host launch gaps between kernels; PyTorch's CUDA graphs notes: warm up on a side
stream, static inputs, capture), timed by CUDA events; when capture fails the eager pass is timed by
the same events and the JSON says so. On the CPU the clock is `time.perf_counter`.

The output is the truth file's JSON form (`h100-blocks.json`): top-level `device`, `torch`,
`measured`, `gemm` [{M, N, K, s, tflops}] and `layers` [{model, tp, mbs, flash, fwd_s, bwd_s,
fwd_bwd_s}], plus `dtype`, `timing`, `warmup`, `repeats` and `tool` saying how it was made; a layer
validation suite (suites.py, metric layer_seconds) reads it as its `data`.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..errors import PhazeError
from ..workload import layers
from ..workload.graphs import build_layer_graph
from ..workload.models import ATTENTIONS, ModelConfig
from ..workload.ops import NET, TC, TCVC, LayerGraph
from .suites import LAYER_KERNELS

DEVICES = ("cuda", "cpu")
# How the block's kernels are launched (the truth file's `kernels`, suites.LAYER_KERNELS): `eager` runs
# one PyTorch kernel per operator (as the shipped truth file, and the traced graphs' op list);
# `inductor` compiles the block with torch.compile (TorchInductor: element-wise chains, norms and
# activations fused into generated Triton kernels; GEMMs and SDPA stay library calls), the nearest
# stand-in for a fusing training stack (Transformer Engine / Megatron-Core fused kernels) that
# installs with PyTorch alone.
KERNELS = LAYER_KERNELS
TOOL = "phaze-opt measure"
WEIGHT_STD = 0.02  # GPT-2/Megatron's initialisation (Radford et al. 2019); the values do not change the work
NO_CUDA = ("measure: --device cuda: no CUDA device is available (torch.cuda.is_available() is false); "
           "use --device cpu")


@dataclasses.dataclass(frozen=True)
class Block:
    """A materialised block with its static input and output gradient (the tensors graphs capture)."""

    module: torch.nn.Module
    x: torch.Tensor  # [seq, mbs, hidden], requires grad, as the traced layer input
    grad: torch.Tensor  # the output gradient fed to backward
    flash: bool
    kernels: str = "eager"

    def forward(self) -> torch.Tensor:
        with device_kernels(self.flash):
            return self.module(self.x)

    def forward_backward(self) -> None:
        with device_kernels(self.flash):
            backward(self.module(self.x), self.grad)


def backward(out, grad: torch.Tensor) -> None:
    """Backward of a block's output: a MoE block also returns its load-balancing loss, which training
    adds to the model's loss (Switch Transformer, Fedus et al. 2022, eq. 4), so its gradient (one) flows too."""
    if isinstance(out, tuple):
        torch.autograd.backward([out[0], *out[1:]], [grad, *(torch.ones_like(t) for t in out[1:])])
    else:
        out.backward(grad)


def check_device(device: str) -> torch.device:
    if device not in DEVICES:
        raise PhazeError(f"measure: --device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise PhazeError(NO_CUDA)
    return torch.device(device)


def check_tp(model: ModelConfig, tp: int) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp not in model.tp_widths:
        raise PhazeError(
            f"measure: --tp {tp}: model {model.name} shards over TP widths {', '.join(map(str, model.tp_widths))} "
            f"only (each divides its {model.heads} heads, {model.kv_heads} KV heads and {model.ffn} FFN columns)"
        )
    return tp


def with_attention(model: ModelConfig, attention: str | None) -> ModelConfig:
    if attention is None or attention == model.attention:
        return model
    if attention not in ATTENTIONS:
        raise PhazeError(f"measure: --attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    return dataclasses.replace(model, attention=attention)


def device_dtype(model: ModelConfig, device: torch.device) -> str:
    """The model's dtype (bf16 unless its config says otherwise) where the device multiplies in it,
    else fp32: a CPU build without bf16 GEMMs, or a GPU older than Ampere, still measures."""
    wanted = model.dtype
    if wanted == "fp32":
        return wanted
    if device.type == "cuda" and wanted == "bf16" and not torch.cuda.is_bf16_supported():
        return "fp32"
    try:
        a = torch.ones(4, 4, device=device, dtype=layers.TORCH_DTYPES[wanted])
        (a @ a).sum().item()
    except (RuntimeError, NotImplementedError):
        return "fp32"
    return wanted


# --- the module on the device ----------------------------------------------------------------------


def _identity(x, *_args, **_kwargs):
    return x


def _sdpa_attention(q, k, v, kv_heads: int, g: int, causal: bool, p: float, scale: float, window: int = 0,
                    unrepeated_kv: bool = False):
    """`layers.flash_attention` on a real device: PyTorch's fused attention in the traced op's layout.

    q is [b kv, s g, d] with the g query heads of a KV group stacked along the rows (row r is position
    r // g), k [b kv, s, d] and v [b kv, s, dv]; the result is O in [s, b, kv, g, dv], as the traced op
    writes it. A sliding window passes its mask explicitly (SDPA then picks a kernel that takes one).
    Grouped KV heads are repeated to the query heads, so that every SDPA backend applies, unless
    `unrepeated_kv` (SDPA's `enable_gqa`: the kernel then saves K and V as a fused kernel keeps them).
    """
    bkv, rows, d = q.shape
    b, s, dv = bkv // kv_heads, rows // g, v.shape[-1]
    qh = q.reshape(b, kv_heads, s, g, d).transpose(2, 3).reshape(b, kv_heads * g, s, d)
    kh, vh = k.reshape(b, kv_heads, s, d), v.reshape(b, kv_heads, s, dv)
    gqa = {"enable_gqa": True} if unrepeated_kv and g > 1 else {}
    if g > 1 and not gqa:  # grouped-query attention: each KV head serves its g query heads
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    if causal and 0 < window < s:
        visible = ~layers.attention_mask(s, window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, dropout_p=p, scale=scale, **gqa)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=p, is_causal=causal, scale=scale, **gqa)
    return out.reshape(b, kv_heads, g, s, dv).permute(3, 0, 1, 2, 4).contiguous(), None


@contextmanager
def device_kernels(flash: bool):
    """Run `workload.layers` modules on a real device: no collectives; fused attention by SDPA.

    The module looks these names up in its own module's globals at call time, so swapping them
    changes nothing but the two kernels (see the module docstring), and only inside the block.
    """
    swaps = {"copy_to_tp": _identity, "reduce_from_tp": _identity}
    if flash:
        swaps["flash_attention"] = _sdpa_attention
    saved = {name: getattr(layers, name) for name in swaps}
    try:
        for name, fn in swaps.items():
            setattr(layers, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(layers, name, fn)


def materialise_block(model: ModelConfig, tp: int, mbs: int, device: torch.device, dtype: str = "bf16",
                      seed: int = 0, kernels: str = "eager") -> Block:
    """The model's transformer block at TP width `tp` (`layers.build_layer`, the traced module) with
    random weights on `device`, and a random input and output gradient of one microbatch; compiled by
    TorchInductor when `kernels` is `inductor` (the weights are the same module's)."""
    model = dataclasses.replace(model, dtype=dtype)
    torch.manual_seed(seed)
    module = layers.build_layer(model, "block", tp).to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, WEIGHT_STD)
            elif name.rsplit(".", 1)[-1] == "bias":
                param.zero_()
            else:  # norm gains
                param.fill_(1.0)
    module.train()  # dropout on, as in training
    torch_dtype = layers.TORCH_DTYPES[dtype]
    x = torch.randn(model.seq, mbs, model.hidden, device=device, dtype=torch_dtype, requires_grad=True)
    grad = torch.randn(model.seq, mbs, model.hidden, device=device, dtype=torch_dtype)
    if kernels == "inductor":
        module = torch.compile(module)
    return Block(module=module, x=x, grad=grad, flash=model.attention == "flash", kernels=kernels)


def counted_flops(block: Block) -> tuple[float, float]:
    """(forward, backward) matrix-multiply FLOPs of the block as PyTorch runs it, counted by
    `torch.utils.flop_counter.FlopCounterMode` (2 per multiply-add, GEMMs and attention kernels)."""
    with FlopCounterMode(display=False) as fwd:
        with device_kernels(block.flash):
            y = block.module(block.x)
    with FlopCounterMode(display=False) as bwd:
        backward(y, block.grad)
    block.module.zero_grad(set_to_none=True)
    block.x.grad = None
    return float(fwd.get_total_flops()), float(bwd.get_total_flops())


def traced_gemm_flops(graph: LayerGraph, kind: str = "block") -> tuple[float, float]:
    """(forward, backward) GEMM FLOPs of a traced layer: 2 b M K N per tensor-core GEMM (a fused
    attention op's GEMMs each), without the bias epilogues a FLOP counter of matmuls leaves out."""
    def gemms(op):
        if op.unit == TCVC:
            return op.gemms
        return (op.gemm,) if op.unit == TC else ()

    return tuple(float(sum(2 * b * m * k * n for op in graph.op_graphs[kind][p].ops for (b, m, k, n) in gemms(op)))
                 for p in ("fwd", "bwd"))


def block_gemm_shapes(graph: LayerGraph, kind: str = "block") -> list[tuple[int, int, int]]:
    """(M, N, K) of the block's forward linear layers (unbatched GEMMs), in graph order, each once:
    the shapes of the truth file's `gemm` entries (QKV, projection, the MLP's two)."""
    shapes = []
    for op in graph.op_graphs[kind]["fwd"].ops:
        if op.unit == TC and op.gemm and op.gemm[0] == 1:
            _, m, k, n = op.gemm
            if (m, n, k) not in shapes:
                shapes.append((m, n, k))
    return shapes


def collective_ops(graph: LayerGraph, kind: str = "block") -> int:
    """Collectives in the traced layer: what `device_kernels` leaves out of a measurement."""
    return sum(op.unit == NET for p in ("fwd", "bwd") for op in graph.op_graphs[kind][p].ops)


# --- clocks ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timed:
    seconds: float  # median of the repeats
    method: str  # cuda-graph | cuda-events | perf_counter, and why a capture fell back


def time_cpu(fn: Callable[[], object], warmup: int, repeats: int) -> Timed:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timed(statistics.median(times), "perf_counter")


def time_cuda(fn: Callable[[], object], warmup: int, repeats: int, graphs: bool = True) -> Timed:
    """Median seconds of `fn` by CUDA events; replayed from a CUDA graph unless capture fails.

    PyTorch's CUDA graphs notes (torch.cuda.graphs, "Whole-network capture"): warm up on a side
    stream before capturing (lazy initialisation, cuBLAS workspaces and autograd's buffers must not
    happen inside the capture), and capture over static inputs; `fn` closes over them. Parameter and
    input gradients exist after the warm-up, so the captured backward accumulates into them in place
    as the eager one does.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    run, method = fn, "cuda-events (eager)"
    if graphs:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            run, method = graph.replay, "cuda-graph"
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # an op that syncs with the host or is not capturable
            torch.cuda.synchronize()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            method = f"cuda-events (eager: CUDA graph capture failed: {reason[:200]})"
            run = fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return Timed(statistics.median(times), method)


def timer(device: torch.device, graphs: bool = True):
    if device.type == "cuda":
        return lambda fn, warmup, repeats: time_cuda(fn, warmup, repeats, graphs)
    return time_cpu


# --- measurements ---------------------------------------------------------------------------------


class NoiseBound(Exception):
    """The backward's time, a difference of two medians, is not positive: the clock's noise is larger."""


def time_block(block: Block, clock, warmup: int, repeats: int) -> tuple[dict, str]:
    """One truth-file `layers` entry's times, and how they were taken."""
    with torch.autograd.set_grad_enabled(True):
        fwd = clock(block.forward, warmup, repeats)
        both = clock(block.forward_backward, warmup, repeats)
    bwd = both.seconds - fwd.seconds
    if not bwd > 0:
        raise NoiseBound(f"the forward-and-backward median ({both.seconds:.3g} s) is not above the forward median "
                         f"({fwd.seconds:.3g} s): the timings are noise at this size; raise --repeats")
    method = fwd.method if fwd.method == both.method else f"forward {fwd.method}; forward+backward {both.method}"
    return {"fwd_s": fwd.seconds, "bwd_s": bwd, "fwd_bwd_s": fwd.seconds + bwd}, method


def time_gemms(shapes, device: torch.device, dtype: str, clock, warmup: int, repeats: int) -> list[dict]:
    """Plain (M x K) @ (K x N) GEMMs, as the truth file's `gemm` entries (written into a fixed output)."""
    torch_dtype = layers.TORCH_DTYPES[dtype]
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch_dtype)
        b = torch.randn(k, n, device=device, dtype=torch_dtype)
        c = torch.empty(m, n, device=device, dtype=torch_dtype)
        t = clock(lambda: torch.mm(a, b, out=c), warmup, repeats).seconds
        out.append({"M": m, "N": n, "K": k, "s": t, "tflops": 2 * m * n * k / t / 1e12})
        del a, b, c
    return out


def saved_storage_bytes(module: torch.nn.Module, run: Callable[[], object]) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves while `run` (a forward of `module`) runs, the
    module's parameters excluded, and what `run` returned: the truth a saved-activation count is
    held to (a view keeps its whole storage, so storages, not tensors, are counted)."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            storages[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def measure(model: ModelConfig, tps=1, mbss=1, *, device: str = "cuda", attentions=(None,), repeats: int = 10,
            warmup: int = 3, gemms: bool = False, cuda_graphs: bool = True, seed: int = 0,
            kernels=("eager",)) -> dict:
    """Time one block of `model` at every (kernels, tp, mbs, attention) of the grid on `device`; the
    truth file's JSON form (module docstring) plus a per-row `summary` for the terminal.

    `tps`, `mbss`, `attentions` and `kernels` are one value or a list each; an attention of None is
    the model's own kernel choice. Every argument is checked before anything runs: a bad one, or a missing
    device, is a one-line PhazeError. A configuration that does not fit in the device's memory, or
    whose backward time drowns in the clock's noise, is left out of `layers` and listed under
    `skipped` with the reason, so that one shard does not lose a grid; none measured is an error.
    """
    dev = check_device(device)
    grid = []
    for launch in _listed(kernels):
        if launch not in KERNELS:
            raise PhazeError(f"measure: --kernels must be one of {', '.join(KERNELS)}, got {launch!r}")
        for attention in _listed(attentions):
            m = with_attention(model, attention)
            for tp in _listed(tps):
                check_tp(m, tp)
                for mbs in _listed(mbss):
                    grid.append((launch, m, tp, _count(mbs, "--mbs")))
    _count(repeats, "--repeats")
    _count(warmup, "--warmup", zero=True)
    graphs = {(m.attention, tp, mbs): build_layer_graph(m, tp, mbs) for _, m, tp, mbs in grid}  # the modelled blocks
    dtype = device_dtype(model, dev)
    clock = timer(dev, cuda_graphs)
    rows, summary, skipped, methods, shapes = [], [], [], [], []
    for launch, m, tp, mbs in grid:
        graph = graphs[(m.attention, tp, mbs)]
        key = {"model": m.name, "tp": tp, "mbs": mbs, "flash": m.attention == "flash", "kernels": launch}
        try:
            block = materialise_block(m, tp, mbs, dev, dtype, seed, launch)
            times, method = time_block(block, clock, warmup, repeats)
        except torch.OutOfMemoryError:
            skipped.append({**key, "reason": f"out of memory on {device_name(dev)} (try a larger --tp or a smaller --mbs)"})
            continue
        except NoiseBound as exc:
            skipped.append({**key, "reason": str(exc)})
            continue
        finally:
            block = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        rows.append({**key, **times})
        methods.append(method)
        fwd_flops, bwd_flops = (graph.op_graphs["block"][p].flops for p in ("fwd", "bwd"))
        summary.append({**key, "seq": graph.seq, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops,
                        "fwd_tflops": fwd_flops / times["fwd_s"] / 1e12, "bwd_tflops": bwd_flops / times["bwd_s"] / 1e12,
                        "collectives_left_out": collective_ops(graph)})
        shapes += [s for s in block_gemm_shapes(graph) if s not in shapes]
    gemm = []
    if gemms:
        for shape in shapes:
            try:
                gemm += time_gemms([shape], dev, dtype, clock, warmup, repeats)
            except torch.OutOfMemoryError:
                skipped.append({"gemm": list(shape), "reason": f"out of memory on {device_name(dev)}"})
    if not rows:
        raise PhazeError(f"measure: nothing measured: {model.name} tp {skipped[0]['tp']} mbs {skipped[0]['mbs']}: "
                         f"{skipped[0]['reason']}")
    return {
        "device": device_name(dev),
        "torch": torch.__version__,
        "measured": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "gemm": gemm,
        "layers": rows,
        "dtype": dtype,
        "timing": "; ".join(dict.fromkeys(methods)),
        "warmup": warmup,
        "repeats": repeats,
        "tool": TOOL,
        "skipped": skipped,
        "summary": summary,  # not written to the file: the traced graph's FLOPs over the medians
    }


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _count(value, flag: str, zero: bool = False) -> int:
    low = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative" if zero else "a positive"
        raise PhazeError(f"measure: {flag} must be {kind} integer, got {value!r}")
    return value


def truth_json(result: dict) -> dict:
    """The part of `measure`'s result written to the JSON file (the summary is for the terminal)."""
    return {k: v for k, v in result.items() if k != "summary"}
