"""Exact solvers: the per-layer operator schedule (`schedule/`: MIP and branch and bound) and the
device placement (`placement/`: DP), each checked by an independent verifier."""
