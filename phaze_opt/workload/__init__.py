"""Workloads: model configs, meta-device PyTorch layers, traced operator graphs and layer graphs."""
