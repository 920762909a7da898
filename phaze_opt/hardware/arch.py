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
"""

from __future__ import annotations

import os

from .. import configs
from ..errors import config_error
from .accelerator import Accelerator
from .memory import HBM_BW_BY_GIB, glb_bandwidth

GIB = 2**30
MIB = 2**20

REQUIRED = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_mib", "hbm_gib", "clock_ghz")
OPTIONAL = ("name", "description", "sources", "glb_bw_gbps", "hbm_bw_gbps")


def accelerator_from_mapping(data: dict, file, default_name: str = "") -> Accelerator:
    """Validate an arch mapping and build the Accelerator; every mistake is a one-line PhazeError."""
    configs.check_keys(data, file, REQUIRED, OPTIONAL)
    ints = {k: configs.positive_int(data, k, file) for k in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width")}
    glb_mib = configs.positive_number(data, "glb_mib", file)
    hbm_gib = configs.positive_number(data, "hbm_gib", file)
    clock_hz = configs.positive_number(data, "clock_ghz", file) * 1e9
    if "hbm_bw_gbps" in data:
        hbm_bw = configs.positive_number(data, "hbm_bw_gbps", file) * 1e9
    elif hbm_gib in HBM_BW_BY_GIB:
        hbm_bw = HBM_BW_BY_GIB[int(hbm_gib)]
    else:
        raise config_error(file, "hbm_bw_gbps", f"required when hbm_gib is not one of {sorted(HBM_BW_BY_GIB)} GiB")
    if "glb_bw_gbps" in data:
        glb_bw = configs.positive_number(data, "glb_bw_gbps", file) * 1e9
    else:
        glb_bw = glb_bandwidth(ints["num_tc"], ints["tc_x"], ints["tc_y"], ints["num_vc"], ints["vc_width"], clock_hz)
    name = data.get("name", default_name)
    if not isinstance(name, str):
        raise config_error(file, "name", f"must be a string, got {name!r}")
    return Accelerator(
        glb_bytes=int(round(glb_mib * MIB)), glb_bw=float(glb_bw), hbm_bytes=int(round(hbm_gib * GIB)),
        hbm_bw=float(hbm_bw), clock_hz=float(clock_hz), name=name, **ints,
    )


def load_arch(name_or_path: str | os.PathLike) -> Accelerator:
    data, path = configs.load("archs", name_or_path)
    return accelerator_from_mapping(data, path, default_name=path.stem)


def available_archs() -> list[str]:
    return configs.available("archs")
