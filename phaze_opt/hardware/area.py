"""Silicon area of an accelerator, in mm^2, from an analytical model fitted to the published system.

The published system (Phaze, ICML 2024) computed the area of each design with Accelergy/CACTI at the
component level; `phaze_opt/data/phaze-cores.json.gz` holds the result for its 29,360 designs. Its
generator builds a chip as (msr-fiddle/phaze, Estimator/architecture.py, `generate_area_of_acc`):

    area = tensor cores + vector cores + one global buffer

where every core is a PE array (a MAC plus a small register file per PE) with its own local (L2)
SRAM, and a vector core is a `vc_width x 1` array. We model each of those terms the way an architect
would budget them:

    area_mm2 = fixed
             + G * (glb_density + glb_density_per_doubling * log2 G)          G = GLB in MiB
             + num_tc * (tc_core + pe * tc_x * tc_y + l2_density * L2_tc)      (um^2 terms, KiB)
             + num_vc * (vc_core + vc_lane * vc_width + l2_density * L2_vc)

- `fixed`: chip-level overhead independent of the design choices;
- GLB SRAM: area per MiB, with a density that changes by a constant per doubling of the array
  (periphery and wiring amortise differently as CACTI picks a larger bank organisation);
- per-core overhead (control, NoC port), per-PE area (MAC + register file), per-lane area;
- per-core local SRAM sized by the published rule (16 bytes per PE, at least 1 KiB; hardware.memory).

Number formats beyond BF16 (`Accelerator.tc_datatypes`) add datapath to every PE, charged as a
fraction of the fitted per-PE area (`datatype_fraction`). The published design set is BF16 only,
so these are derived, not fitted: a BF16 MAC's 8 x 8-bit mantissa multiplier dominates its PE;
FP8 at twice the rate needs two 4 x 4 (E4M3) or 3 x 3 (E5M2) products, their exponent adds and a
second input to the FP32 adder. Built on partitioned partial-product cells of the BF16 multiplier
(the precision-scalable MAC of Camus et al., "Review and Benchmarking of Precision-Scalable
Multiply-Accumulate Unit Architectures for Embedded Neural-Network Processing", IEEE JETCAS 2019,
whose sub-word-parallel designs spend tens of percent of a MAC's area on the extra modes), we put
the FP8 datapath at 15% of a PE at 2x rate (uncertain by about 2x either way: 7-30%), scaled by
the declared rate over 2. MX block scaling adds an 8-bit shared-exponent add per block at the
array edge: 3% on top of the FP8 datapath (with or without plain FP8 listed, the datapath is
counted once). NVFP4 at 4x rate (four 2 x 2 products, a 4-input adder tree, its E4M3 block
scales): 12%, scaled by rate over 4. These constants live in `DATATYPE_PE_FRACTION`.

The constants are fitted by least squares on relative error, with every term but the density slope
kept non-negative, and live in `configs/area.yaml` with their provenance; the published design set
and the fit are `hardware/calibrate.py` (refit with `python -m phaze_opt.hardware.calibrate --fit --write`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import configs
from ..errors import config_error, shown
from .accelerator import BF16_ONLY, Accelerator
from .memory import l2_bytes

MIB = 2**20
KIB = 2**10

CONSTANT_FIELDS = (
    "fixed_mm2",
    "glb_mm2_per_mib",
    "glb_mm2_per_mib_per_doubling",
    "tc_core_um2",
    "vc_core_um2",
    "pe_um2",
    "vc_lane_um2",
    "l2_um2_per_kib",
)
SIGNED_FIELDS = ("glb_mm2_per_mib_per_doubling",)
# Extra PE area per number format, as a fraction of the fitted BF16 PE (`pe_um2`) at the format's
# nominal rate (module docstring: derived, uncertain ~2x): (fraction, nominal MACs per PE per cycle).
FP8_DATAPATH = (0.15, 2.0)
MX_BLOCK_SCALING = 0.03
DATATYPE_PE_FRACTION = {"nvfp4": (0.12, 4.0)}


def datatype_fraction(tc_datatypes) -> float:
    """Extra PE area of the tensor cores' number formats beyond BF16, as a fraction of a BF16 PE."""
    rates = dict(tc_datatypes)
    fp8_rate = max(rates.get("fp8", 0.0), rates.get("mxfp8", 0.0))
    out = FP8_DATAPATH[0] * fp8_rate / FP8_DATAPATH[1] if fp8_rate else 0.0
    if "mxfp8" in rates:
        out += MX_BLOCK_SCALING
    for name, (fraction, nominal) in DATATYPE_PE_FRACTION.items():
        if name in rates:
            out += fraction * rates[name] / nominal
    return out


@dataclass(frozen=True)
class AreaConstants:
    fixed_mm2: float
    glb_mm2_per_mib: float
    glb_mm2_per_mib_per_doubling: float
    tc_core_um2: float
    vc_core_um2: float
    pe_um2: float
    vc_lane_um2: float
    l2_um2_per_kib: float

    def as_vector(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in CONSTANT_FIELDS], dtype=float)


def constants_path() -> Path:
    return configs.constants_file("area.yaml")


def load_constants(path: str | os.PathLike | None = None) -> AreaConstants:
    """Read and validate the fitted constants (cached per file and modification time)."""
    return configs.load_constants(
        path if path is not None else constants_path(),
        "area constants file not found (refit with `python -m phaze_opt.hardware.calibrate --fit --write`)",
        _parse_constants)


def _parse_constants(path: str, data) -> AreaConstants:
    if not isinstance(data, dict) or not isinstance(data.get("constants"), dict):
        raise config_error(path, "constants", "missing mapping of fitted constants")
    c = data["constants"]
    configs.check_keys(c, path, CONSTANT_FIELDS)
    values = {}
    for f in CONSTANT_FIELDS:
        v = configs.finite_number(c[f], path, f"constants.{f}")
        if f not in SIGNED_FIELDS and v < 0:
            raise config_error(path, f"constants.{f}", f"must be >= 0, got {shown(c[f])}")
        values[f] = v
    return AreaConstants(**values)


def _glb_mib_terms(glb_bytes):
    g = np.asarray(glb_bytes, dtype=float) / MIB
    with np.errstate(divide="ignore", invalid="ignore"):
        glog = np.where(g > 0, g * np.log2(np.where(g > 0, g, 1.0)), 0.0)
    return g, glog


def design_features(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes) -> np.ndarray:
    """Design matrix in CONSTANT_FIELDS order: each column is what one constant multiplies (mm^2 units)."""
    num_tc, tc_x, tc_y, num_vc, vc_width = (np.asarray(a, dtype=float) for a in (num_tc, tc_x, tc_y, num_vc, vc_width))
    g, glog = _glb_mib_terms(glb_bytes)
    l2_kib = (num_tc * l2_bytes(tc_x * tc_y) + num_vc * l2_bytes(vc_width)) / KIB
    um2 = 1e-6  # the per-core, per-PE and per-KiB constants are in um^2
    cols = np.broadcast_arrays(
        np.ones_like(g), g, glog, num_tc * um2, num_vc * um2, num_tc * tc_x * tc_y * um2, num_vc * vc_width * um2,
        l2_kib * um2,
    )
    return np.stack(cols, axis=-1)


def area_mm2_arrays(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes, constants: AreaConstants | None = None,
                    datatypes=0.0) -> np.ndarray:
    """Vectorised area over arrays of design fields (broadcast together); `datatypes` is the extra
    PE fraction of the number formats beyond BF16 (`datatype_fraction`, an array or a scalar)."""
    c = constants or load_constants()
    area = design_features(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes) @ c.as_vector()
    extra = np.asarray(datatypes, dtype=float)
    if not np.any(extra):  # BF16 only: the fitted model, bit for bit
        return area
    pes = np.asarray(num_tc, dtype=float) * np.asarray(tc_x, dtype=float) * np.asarray(tc_y, dtype=float)
    return area + pes * c.pe_um2 * 1e-6 * extra


def area_mm2(accel: Accelerator, constants: AreaConstants | None = None) -> float:
    return float(area_mm2_arrays(accel.num_tc, accel.tc_x, accel.tc_y, accel.num_vc, accel.vc_width, accel.glb_bytes,
                                 constants, datatype_fraction(accel.tc_datatypes)))


def breakdown(accel: Accelerator, constants: AreaConstants | None = None) -> dict[str, float]:
    """Area per component in mm^2 (they sum to `area_mm2`), for reports."""
    c = constants or load_constants()
    f = design_features(accel.num_tc, accel.tc_x, accel.tc_y, accel.num_vc, accel.vc_width, accel.glb_bytes)
    part = dict(zip(CONSTANT_FIELDS, f * c.as_vector()))
    return {
        "fixed": float(part["fixed_mm2"]),
        "glb_sram": float(part["glb_mm2_per_mib"] + part["glb_mm2_per_mib_per_doubling"]),
        "tensor_cores": float(part["tc_core_um2"] + part["pe_um2"]),
        "vector_cores": float(part["vc_core_um2"] + part["vc_lane_um2"]),
        "local_sram": float(part["l2_um2_per_kib"]),
        **({"datatypes": float(part["pe_um2"] * datatype_fraction(accel.tc_datatypes))}
           if accel.tc_datatypes != BF16_ONLY else {}),
    }


# ---- calibration against the published design set -------------------------------------------------
