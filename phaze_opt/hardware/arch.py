"""Reference architectures from `configs/archs/*.yaml` (or the user's own file) as `Accelerator`s.

A file states the chip in the units of a datasheet (GHz, MiB, GiB, GB/s); this module converts them to
SI on load. Fields:

    name, description, sources       free text (name defaults to the file name)
    num_tc, tc_x, tc_y               tensor cores and their PE array (x columns, y rows)
    num_vc, vc_width                 vector cores and their lanes
    glb_mib                          global buffer, MiB
    glb_bw_gbps                      optional; default: the published system's rule (hardware.memory)
    hbm_gib, hbm_bw_gbps             off-chip memory; bandwidth defaults to the per-capacity table
    clock_ghz
    tc_datatypes                     optional mapping {format: MACs per PE per cycle}: the number
                                     formats the tensor cores multiply (bf16: 1, the template's
                                     unit, must be listed; fp8, mxfp8, nvfp4 as the chip has them);
                                     absent = BF16 only
    tc_fp8_any_layout                optional true | false (default false): the tensor cores read a
                                     per-tensor FP8 operand in either major order (Blackwell), so an
                                     FP8 recipe keeps one weight copy, not a transposed second one
    efficiency                       optional mapping: how well the software stack uses the template
                                     (hardware/efficiency.py: gemm_tile_reuse, gemm_wave_balance,
                                     tc_fraction, hbm_fraction, op_overhead_s); absent = identity,
                                     the bare template
"""

from __future__ import annotations

import os

from .. import configs
from ..configs import Limit
from ..errors import config_error, shown
from ..training import PRECISIONS
from .accelerator import Accelerator
from .efficiency import efficiency_from_mapping
from .memory import HBM_BW_BY_GIB, glb_bandwidth

GIB = 2**30
MIB = 2**20

# Upper limits of every field, in the file's units, each 10-100x beyond the largest chip built, so
# that only a typo or a hostile file reaches one (the schedules name every core, and the latency
# and area models multiply these together). Non-finite values (.inf, .nan) are refused as well.
LIMITS = {
    # An H100 has 528 tensor cores and 132 SMs of 4 vector units; 2^16 = 65,536 is 124x that.
    "num_tc": Limit(2**16, "124x the 528 tensor cores of an H100"),
    "num_vc": Limit(2**16, "124x the 528 vector units of an H100"),
    # The largest systolic arrays are 256 x 256 (TPU v1, v6e); 4,096 is 16x a side.
    "tc_x": Limit(4096, "16x the largest systolic array side, 256"),
    "tc_y": Limit(4096, "16x the largest systolic array side, 256"),
    # Vector units: 128 lanes (TPU VPU rows, AVX-512 at 16 bits: 32); 4,096 is 32x that.
    "vc_width": Limit(4096, "32x the widest vector unit, 128 lanes"),
    # On-chip SRAM: 128 MiB (TPU v4 CMEM), 44 GB on a wafer-scale Cerebras WSE-3; 1 TiB is 24x that.
    "glb_mib": Limit(2**20, "24x the 44 GB of SRAM on a wafer-scale chip"),
    "glb_bw_gbps": Limit(10**9, "50x the 21 PB/s of a wafer-scale chip's SRAM"),
    # HBM: 192-288 GiB per package at up to 8 TB/s (B200, MI355X).
    "hbm_gib": Limit(2**14, "57x the 288 GiB of the largest HBM package"),
    "hbm_bw_gbps": Limit(10**6, "125x the 8 TB/s of the fastest HBM package"),
    # Clocks: ~2 GHz for accelerators, ~6 GHz for the fastest CPUs.
    "clock_ghz": Limit(100, "16x the fastest clock of any processor, ~6 GHz"),
}

REQUIRED = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_mib", "hbm_gib", "clock_ghz")
OPTIONAL = ("name", "description", "sources", "glb_bw_gbps", "hbm_bw_gbps", "efficiency", "tc_datatypes",
            "tc_fp8_any_layout")
# A format's MAC rate relative to BF16: published chips reach 4x (NVFP4 on Blackwell); 64x is a typo.
MAX_MAC_RATE = Limit(64, "16x the 4x BF16 rate of the fastest published format (NVFP4)")


def tc_datatypes_from_mapping(value, file) -> tuple:
    """The `tc_datatypes` field as (format, rate) pairs; a one-line PhazeError naming the entry."""
    if not isinstance(value, dict) or not value:
        raise config_error(file, "tc_datatypes", f"must be a mapping of {', '.join(PRECISIONS)} to MACs per PE "
                                                 f"per cycle, got {shown(value)}")
    for name in value:
        if name not in PRECISIONS:
            raise config_error(file, f"tc_datatypes.{name}", f"unknown number format; allowed: {', '.join(PRECISIONS)}")
        configs.positive_number(value, name, file, limit=MAX_MAC_RATE, field=f"tc_datatypes.{name}")
    if value.get("bf16") != 1:
        raise config_error(file, "tc_datatypes.bf16", f"must be 1 (the template's BF16 rate), got {shown(value.get('bf16'))}")
    return tuple(value.items())


def accelerator_from_mapping(data: dict, file, default_name: str = "") -> Accelerator:
    """Validate an arch mapping and build the Accelerator; every mistake is a one-line PhazeError."""
    configs.check_keys(data, file, REQUIRED, OPTIONAL)
    ints = {k: configs.positive_int(data, k, file, limit=LIMITS[k]) for k in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width")}
    glb_mib = configs.positive_number(data, "glb_mib", file, limit=LIMITS["glb_mib"])
    hbm_gib = configs.positive_number(data, "hbm_gib", file, limit=LIMITS["hbm_gib"])
    clock_hz = configs.positive_number(data, "clock_ghz", file, limit=LIMITS["clock_ghz"]) * 1e9
    if "hbm_bw_gbps" in data:
        hbm_bw = configs.positive_number(data, "hbm_bw_gbps", file, limit=LIMITS["hbm_bw_gbps"]) * 1e9
    elif hbm_gib in HBM_BW_BY_GIB:
        hbm_bw = HBM_BW_BY_GIB[int(hbm_gib)]
    else:
        raise config_error(file, "hbm_bw_gbps", f"required when hbm_gib is not one of {sorted(HBM_BW_BY_GIB)} GiB")
    if "glb_bw_gbps" in data:
        glb_bw = configs.positive_number(data, "glb_bw_gbps", file, limit=LIMITS["glb_bw_gbps"]) * 1e9
    else:
        glb_bw = glb_bandwidth(ints["num_tc"], ints["tc_x"], ints["tc_y"], ints["num_vc"], ints["vc_width"], clock_hz)
    any_layout = data.get("tc_fp8_any_layout", False)
    if not isinstance(any_layout, bool):
        raise config_error(file, "tc_fp8_any_layout", f"must be true or false, got {shown(any_layout)}")
    name = data.get("name", default_name)
    if not isinstance(name, str):
        raise config_error(file, "name", f"must be a string, got {shown(name)}")
    return Accelerator(
        glb_bytes=int(round(glb_mib * MIB)), glb_bw=float(glb_bw), hbm_bytes=int(round(hbm_gib * GIB)),
        hbm_bw=float(hbm_bw), clock_hz=float(clock_hz), name=name,
        efficiency=efficiency_from_mapping(data.get("efficiency"), file), **ints,
        **({"tc_datatypes": tc_datatypes_from_mapping(data["tc_datatypes"], file)} if "tc_datatypes" in data else {}),
        tc_fp8_any_layout=any_layout,
    )


def load_arch(name_or_path: str | os.PathLike) -> Accelerator:
    data, path = configs.load("archs", name_or_path)
    return accelerator_from_mapping(data, path, default_name=path.stem)


def available_archs() -> list[str]:
    return configs.available("archs")
