"""Exact solvers: the per-layer operator schedule (ILP) and the device placement (DP)."""
