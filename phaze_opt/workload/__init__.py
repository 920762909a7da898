"""Workloads: model configs, meta-device PyTorch layers, traced operator graphs and layer graphs.

Public entry points (import them from their modules; importing this package does not import torch):

- `models.load_model(name_or_path) -> ModelConfig`: a validated model config;
- `graphs.build_layer_graph(model, tp, mbs, seq=None) -> LayerGraph`: the model's layers and their
  forward/backward op graphs at one TP width and microbatch, cached in memory and on disk;
- `trace.trace_layer(module, example_inputs) -> (fwd OpGraph, bwd OpGraph)`: the same tracing for a
  user's own `nn.Module` (`trace.trace_layer_details` also returns parameter and activation bytes).
"""
