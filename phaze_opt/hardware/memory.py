"""Memory-system rules: the figures an architect derives from the searched parameters.

The published system (Phaze, Wang et al., ICML 2024) searches core counts, PE arrays and the GLB size,
but not the GLB bandwidth, the per-core local buffers or the HBM bandwidth; those follow from the
searched values by fixed rules. We keep its rules where it states them and cite a product where it
does not. All functions accept numpy arrays as well as scalars, so a whole grid of designs is derived
in one call.
"""

from __future__ import annotations

import numpy as np

BYTES_PER_WORD = 2  # 16-bit data words (bf16), as Phaze's `bytes_per_element = 2`

# Per-core local (L2) buffer. Phaze sizes it from the PE count of the core: 2**(log2 w + log2 d - 6) KiB,
# i.e. 16 bytes per PE, never below 1 KiB (msr-fiddle/phaze, Estimator/utils/estimator_wrapper.py,
# `create_core_config_for_estimation`). A vector core is a w x 1 array for this purpose.
L2_BYTES_PER_PE = 16
L2_MIN_BYTES = 1024

# GLB bandwidth. Phaze gives the GLB 4096 words per cycle, except for a single core, where the
# bandwidth scales with the core's array edge: min(max(4096 * edge / 256, 4), 4096) words per cycle
# with edge = max(width, depth) (same source). The GLB is shared by the tensor and vector cores, so
# we take the larger of the two core types' figures.
GLB_WORDS_PER_CYCLE = 4096
GLB_SINGLE_CORE_WORDS_PER_EDGE_PE = GLB_WORDS_PER_CYCLE / 256
GLB_MIN_WORDS_PER_CYCLE = 4

# HBM bandwidth per capacity choice, bytes/s. Bandwidth follows the number and generation of stacks:
# - 32 GiB: TPUv4, 4 stacks of 8 GiB HBM2, 1200 GB/s (Jouppi et al., "TPU v4", ISCA 2023, Table 1).
# - 64 GiB: 4 stacks of 16 GiB HBM2e at 3.2 Gbit/s/pin x 1024 pins = 409.6 GB/s each, 1638.4 GB/s
#   (JEDEC HBM2E speed grade as shipped in the A100 80GB).
# - 80 GiB: 5 such stacks, 2048 GB/s; the A100 80GB SXM datasheet quotes 2039 GB/s for this layout.
HBM_BW_BY_GIB = {32: 1200e9, 64: 1638.4e9, 80: 2048e9}


def l2_bytes(pes_per_core):
    """Local buffer of one core with `pes_per_core` PEs (TC: x*y, VC: lanes)."""
    return np.maximum(L2_BYTES_PER_PE * np.asarray(pes_per_core), L2_MIN_BYTES)


def _glb_words_per_cycle(num_cores, edge):
    single = np.clip(GLB_SINGLE_CORE_WORDS_PER_EDGE_PE * np.asarray(edge, dtype=float),
                     GLB_MIN_WORDS_PER_CYCLE, GLB_WORDS_PER_CYCLE)
    return np.where(np.asarray(num_cores) == 1, single, float(GLB_WORDS_PER_CYCLE))


def glb_bandwidth(num_tc, tc_x, tc_y, num_vc, vc_width, clock_hz):
    """GLB bandwidth in bytes/s by Phaze's rule (see module notes)."""
    words = np.maximum(_glb_words_per_cycle(num_tc, np.maximum(tc_x, tc_y)),
                       _glb_words_per_cycle(num_vc, vc_width))
    out = words * BYTES_PER_WORD * np.asarray(clock_hz, dtype=float)
    return float(out) if np.ndim(out) == 0 else out


def hbm_bandwidth(hbm_gib: float, table: dict | None = None) -> float:
    """HBM bandwidth for a capacity choice; KeyError names the capacities the table knows."""
    table = HBM_BW_BY_GIB if table is None else table
    key = int(hbm_gib) if float(hbm_gib).is_integer() else hbm_gib
    if key not in table:
        raise KeyError(f"no HBM bandwidth known for {hbm_gib} GiB; known: {sorted(table)}")
    return float(table[key])
