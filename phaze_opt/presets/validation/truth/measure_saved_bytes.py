"""The device run behind truth/h100-saved-bytes-2026.json: what one transformer block's forward keeps
for its backward on a real GPU, against the tracer's count (`workload.trace`, eager graph), for the
fused QKV projection (Megatron's `linear_qkv`) and separate Q, K and V projections (Meta's published
Llama code). The block is the project's own module (`workload.layers`, the traced one) with random
weights, run by `validation.measure` on CUDA with fused attention as PyTorch's SDPA; grouped KV
heads go to SDPA as they are (`enable_gqa=True`), so that the kernel saves K and V unrepeated, as a
fused attention kernel does. Dense Llama 3 blocks and two MoE blocks (Qwen3-30B-A3B with QK-norm,
Mixtral 8x7B), the MoE ones with the router's weights applied at the combine (the eager default).
Two readings per case:

- `hook_bytes`: the distinct storages autograd saves (torch.autograd.graph.saved_tensors_hooks),
  parameters excluded, as tests/test_workload_graphs.py counts them on the CPU;
- `allocated_bytes`: torch.cuda.memory_allocated after the forward minus before, less the output:
  what stays allocated, the caching allocator's 512-byte rounding and the rotary tables included.

`traced_bytes` is the tracer's count for the same graph (activation_bytes plus what a fused pointwise
kernel would rebuild, which eager autograd keeps), the layer input included. Usage:
python3 measure_saved_bytes.py OUT.json (python3 must hold a CUDA PyTorch, PyYAML and NumPy).
"""
import dataclasses
import functools
import json
import sys

import torch

from phaze_opt.validation import measure
from phaze_opt.workload import layers
from phaze_opt.workload.graphs import trace_kinds
from phaze_opt.workload.models import load_model

CASES = [("llama3-405b", 8, 8192), ("llama3-70b", 8, 8192), ("llama3-8b", 1, 8192), ("llama3-8b", 2, 8192),
         ("qwen3-30b-a3b", 1, 4096), ("mixtral-8x7b", 2, 4096)]  # MoE blocks (capacity buffers, QK-norm)


def forward(block):
    with measure.device_kernels(True):
        layers.flash_attention = functools.partial(measure._sdpa_attention, unrepeated_kv=True)
        return block.module(block.x)


def main(path):
    rows = []
    for name, tp, seq in CASES:
        for qkv in ("fused", "separate"):
            model = dataclasses.replace(load_model(name), seq=seq, qkv_projection=qkv, attention="flash")
            traced = trace_kinds(model, tp, 1, seq, fuse=False)["block"]
            block = measure.materialise_block(model, tp, 1, torch.device("cuda"))
            hook, out = measure.saved_storage_bytes(block.module, lambda: forward(block))
            del out
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            out = forward(block)
            torch.cuda.synchronize()
            outs = out if isinstance(out, tuple) else (out,)  # a MoE block also returns its aux loss
            allocated = torch.cuda.memory_allocated() - before - sum(t.untyped_storage().nbytes() for t in outs)
            rows.append({"model": name, "tp": tp, "seq": seq, "mbs": 1, "qkv_projection": qkv,
                         "traced_bytes": int(traced.activation_bytes + sum(r[3] for r in traced.rebuilt)),
                         "hook_bytes": int(hook), "allocated_bytes": int(allocated)})
            print(json.dumps(rows[-1]), flush=True)
            del out, outs, block
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tool": __doc__.split("\n")[0],
              "cases": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
