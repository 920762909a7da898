"""Workloads: model configs, meta-device PyTorch layers, traced operator graphs and layer graphs.

Public entry points (import them from their modules; importing this package does not import torch):

- `models.load_model(name_or_path) -> ModelConfig`: a validated model config;
- `graphs.build_layer_graph(model, tp, mbs, seq=None, attention=None) -> LayerGraph`: the model's
  layers and their forward/backward op graphs at one TP width and microbatch (`attention="flash"`:
  fused FlashAttention kernels), cached in memory and on disk; each `Layer` prices its activation
  memory by recompute mode and sequence parallelism (`activation_bytes_for`, `checkpoint_bytes`;
  see trace.py);
- `trace.trace_layer(module, example_inputs) -> (fwd OpGraph, bwd OpGraph)`: the same tracing for a
  user's own `nn.Module` (`trace.trace_layer_details` also returns parameter and activation bytes).
"""
