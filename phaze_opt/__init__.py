"""phaze_opt: co-design search over a training accelerator's architecture and the device placement
of a large language model on a cluster of such chips (after Phaze, Wang et al., ICML 2024)."""

__version__ = "0.1.0"
