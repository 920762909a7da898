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

The constants are fitted by least squares on relative error, with every term but the density slope
kept non-negative, and live in `configs/area.yaml` with their provenance. Refit with
`python -m phaze_opt.hardware.area --fit --write`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from .. import configs
from ..errors import PhazeError, config_error
from .accelerator import Accelerator
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


BUNDLED_REFERENCE = Path(__file__).resolve().parents[1] / "data" / "phaze-cores.json.gz"


def reference_path() -> Path:
    """The published design set: `$PHAZE_OPT_REFERENCE`, else the copy bundled with the package.

    The bundled copy (provenance in `phaze_opt/data/README.md`) is what a user's clone has; the
    variable lets a user calibrate against another design set without editing the repository.
    """
    env = os.environ.get("PHAZE_OPT_REFERENCE")
    return Path(env) if env else BUNDLED_REFERENCE


def reference_bytes(path: str | os.PathLike | None = None) -> bytes:
    """The design set's JSON text as bytes, decompressed when the file is gzip (`.gz`).

    The SHA-256 recorded in `configs/area.yaml` is of these bytes, so a compressed and a plain copy
    of the same set have one digest.
    """
    p = Path(path) if path is not None else reference_path()
    if not p.is_file():
        raise PhazeError(f"{p}: reference design set not found (set PHAZE_OPT_REFERENCE to its path)")
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise PhazeError(f"{p}: reference design set is not readable gzip ({exc})") from None
    return raw


def reference_rows(path: str | os.PathLike | None = None) -> list[dict]:
    """The published designs as the file's records (fields as in the published `cores.json`)."""
    p = Path(path) if path is not None else reference_path()
    try:
        rows = json.loads(reference_bytes(p))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PhazeError(f"{p}: reference design set is not JSON ({exc})") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise PhazeError(f"{p}: reference design set must be a non-empty JSON list of design records")
    missing = [k for k in REFERENCE_KEYS if k not in rows[0]]
    if missing:
        raise PhazeError(f"{p}: design records lack field(s) {', '.join(missing)}; expected {', '.join(REFERENCE_KEYS)}")
    return rows


def constants_path() -> Path:
    return configs.constants_file("area.yaml")


def load_constants(path: str | os.PathLike | None = None) -> AreaConstants:
    """Read and validate the fitted constants (cached per file and modification time)."""
    p = Path(path) if path is not None else constants_path()
    return _load_constants(str(p), configs.file_version(
        p, "area constants file not found (refit with `python -m phaze_opt.hardware.area --fit --write`)"))


@lru_cache(maxsize=8)
def _load_constants(path: str, _mtime: int) -> AreaConstants:
    data = configs.read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("constants"), dict):
        raise config_error(path, "constants", "missing mapping of fitted constants")
    c = data["constants"]
    configs.check_keys(c, path, CONSTANT_FIELDS)
    values = {}
    for f in CONSTANT_FIELDS:
        v = c[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise config_error(path, f"constants.{f}", f"must be a number, got {v!r}")
        if f not in SIGNED_FIELDS and v < 0:
            raise config_error(path, f"constants.{f}", f"must be >= 0, got {v!r}")
        values[f] = float(v)
    return AreaConstants(**values)


def _glb_mib_terms(glb_bytes):
    g = np.asarray(glb_bytes, dtype=float) / MIB
    with np.errstate(divide="ignore", invalid="ignore"):
        glog = np.where(g > 0, g * np.log2(np.where(g > 0, g, 1.0)), 0.0)
    return g, glog


def _features(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes) -> np.ndarray:
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


def area_mm2_arrays(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes, constants: AreaConstants | None = None) -> np.ndarray:
    """Vectorised area over arrays of design fields (broadcast together)."""
    c = constants or load_constants()
    return _features(num_tc, tc_x, tc_y, num_vc, vc_width, glb_bytes) @ c.as_vector()


def area_mm2(accel: Accelerator, constants: AreaConstants | None = None) -> float:
    return float(area_mm2_arrays(accel.num_tc, accel.tc_x, accel.tc_y, accel.num_vc, accel.vc_width, accel.glb_bytes, constants))


def breakdown(accel: Accelerator, constants: AreaConstants | None = None) -> dict[str, float]:
    """Area per component in mm^2 (they sum to `area_mm2`), for reports."""
    c = constants or load_constants()
    f = _features(accel.num_tc, accel.tc_x, accel.tc_y, accel.num_vc, accel.vc_width, accel.glb_bytes)
    part = dict(zip(CONSTANT_FIELDS, f * c.as_vector()))
    return {
        "fixed": float(part["fixed_mm2"]),
        "glb_sram": float(part["glb_mm2_per_mib"] + part["glb_mm2_per_mib_per_doubling"]),
        "tensor_cores": float(part["tc_core_um2"] + part["pe_um2"]),
        "vector_cores": float(part["vc_core_um2"] + part["vc_lane_um2"]),
        "local_sram": float(part["l2_um2_per_kib"]),
    }


# ---- calibration against the published design set -------------------------------------------------

REFERENCE_KEYS = ("num_tc", "num_vc", "width", "depth", "width_vc", "GLB_Buffer", "area")


def reference_designs(path: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """The published designs as arrays; `area_mm2` converted from the file's um^2."""
    rows = reference_rows(path)
    out = {k: np.array([r[k] for r in rows]) for k in REFERENCE_KEYS}
    return {
        "num_tc": out["num_tc"], "num_vc": out["num_vc"], "tc_x": out["width"], "tc_y": out["depth"],
        "vc_width": out["width_vc"], "glb_bytes": out["GLB_Buffer"], "area_mm2": out["area"] / 1e6,
    }


def _ref_features(ref: dict) -> np.ndarray:
    return _features(ref["num_tc"], ref["tc_x"], ref["tc_y"], ref["num_vc"], ref["vc_width"], ref["glb_bytes"])


def calibration(constants: AreaConstants | None = None, path=None) -> dict:
    """Relative error of the model on the published set: median, 95th percentile, max."""
    ref = reference_designs(path)
    pred = _ref_features(ref) @ (constants or load_constants()).as_vector()
    rel = np.abs(pred - ref["area_mm2"]) / ref["area_mm2"]
    return {
        "designs": int(rel.size),
        "median_abs_rel_err": float(np.median(rel)),
        "p95_abs_rel_err": float(np.percentile(rel, 95)),
        "max_abs_rel_err": float(rel.max()),
    }


def fit(path=None) -> tuple[AreaConstants, dict]:
    """Least squares on relative error; all constants >= 0 except the GLB density slope."""
    from scipy.optimize import lsq_linear

    ref = reference_designs(path)
    X = _ref_features(ref)
    y = ref["area_mm2"]
    lower = np.array([-np.inf if f in SIGNED_FIELDS else 0.0 for f in CONSTANT_FIELDS])
    sol = lsq_linear(X / y[:, None], np.ones_like(y), bounds=(lower, np.inf), method="bvls")
    constants = AreaConstants(*map(float, sol.x))
    return constants, calibration(constants, path)


def write_constants(constants: AreaConstants, stats: dict, path=None, ref_path=None) -> Path:
    ref = Path(ref_path) if ref_path is not None else reference_path()
    out = Path(path) if path is not None else constants_path()
    from .arch import load_arch  # the budget design, to record its fitted area

    tpuv4 = area_mm2(load_arch("tpuv4"), constants)
    doc = {
        "constants": {k: round(v, 10) for k, v in asdict(constants).items()},
        "provenance": {
            "reference": "msr-fiddle/phaze Estimator/arch_configs/cores.json (MIT), Accelergy/CACTI areas in um^2",
            "reference_sha256": hashlib.sha256(reference_bytes(ref)).hexdigest(),
            "method": "bounded linear least squares on relative error (scipy lsq_linear, bvls); "
                      "python -m phaze_opt.hardware.area --fit --write",
            "designs": stats["designs"],
            "median_abs_rel_err": round(stats["median_abs_rel_err"], 6),
            "p95_abs_rel_err": round(stats["p95_abs_rel_err"], 6),
            "max_abs_rel_err": round(stats["max_abs_rel_err"], 6),
            "tpuv4_area_mm2": round(tpuv4, 3),
            "tpuv4_reference_area_mm2": 278.827,
        },
    }
    header = ("# Fitted constants of the analytical area model (phaze_opt/hardware/area.py), in mm^2 and um^2.\n"
              "# Generated; edit by refitting, not by hand.\n")
    out.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phaze_opt.hardware.area", description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the constants on the reference design set")
    parser.add_argument("--write", action="store_true", help="with --fit: write them to configs/area.yaml")
    args = parser.parse_args(argv)
    try:
        if args.fit:
            constants, stats = fit()
            print(json.dumps({"constants": asdict(constants), **stats}, indent=2))
            if args.write:
                print(f"wrote {write_constants(constants, stats)}")
        else:
            print(json.dumps(calibration(), indent=2))
    except PhazeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
