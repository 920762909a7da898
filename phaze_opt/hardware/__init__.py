"""Hardware: the accelerator template, its area, search spaces and per-operator latency."""
