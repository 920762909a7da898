"""Calibrating the area model: the published design set and the least-squares fit of `configs/area.yaml`.

    python -m phaze_opt.hardware.calibrate            # the model's error on the published designs
    python -m phaze_opt.hardware.calibrate --fit      # refit the constants (print them)
    python -m phaze_opt.hardware.calibrate --fit --write   # and write configs/area.yaml

The model itself (`area_mm2`, its terms and constants) is `hardware/area.py`; this module is the
tooling that produced its constants, kept apart so evaluating a design never loads the design set.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import yaml

from ..errors import PhazeError
from .arch import load_arch
from .area import CONSTANT_FIELDS, SIGNED_FIELDS, AreaConstants, area_mm2, constants_path, design_features, load_constants

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


REFERENCE_KEYS = ("num_tc", "num_vc", "width", "depth", "width_vc", "GLB_Buffer", "area")


def reference_designs(path: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """The published designs as arrays; `area_mm2` converted from the file's um^2."""
    rows = reference_rows(path)
    out = {k: np.array([r[k] for r in rows]) for k in REFERENCE_KEYS}
    return {
        "num_tc": out["num_tc"], "num_vc": out["num_vc"], "tc_x": out["width"], "tc_y": out["depth"],
        "vc_width": out["width_vc"], "glb_bytes": out["GLB_Buffer"], "area_mm2": out["area"] / 1e6,
    }


def reference_features(ref: dict) -> np.ndarray:
    return design_features(ref["num_tc"], ref["tc_x"], ref["tc_y"], ref["num_vc"], ref["vc_width"], ref["glb_bytes"])


def calibration(constants: AreaConstants | None = None, path=None) -> dict:
    """Relative error of the model on the published set: median, 95th percentile, max."""
    ref = reference_designs(path)
    pred = reference_features(ref) @ (constants or load_constants()).as_vector()
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
    X = reference_features(ref)
    y = ref["area_mm2"]
    lower = np.array([-np.inf if f in SIGNED_FIELDS else 0.0 for f in CONSTANT_FIELDS])
    sol = lsq_linear(X / y[:, None], np.ones_like(y), bounds=(lower, np.inf), method="bvls")
    constants = AreaConstants(*map(float, sol.x))
    return constants, calibration(constants, path)


def write_constants(constants: AreaConstants, stats: dict, path=None, ref_path=None) -> Path:
    ref = Path(ref_path) if ref_path is not None else reference_path()
    out = Path(path) if path is not None else constants_path()
    tpuv4 = area_mm2(load_arch("tpuv4"), constants)
    doc = {
        "constants": {k: round(v, 10) for k, v in asdict(constants).items()},
        "provenance": {
            "reference": "msr-fiddle/phaze Estimator/arch_configs/cores.json (MIT), Accelergy/CACTI areas in um^2",
            "reference_sha256": hashlib.sha256(reference_bytes(ref)).hexdigest(),
            "method": "bounded linear least squares on relative error (scipy lsq_linear, bvls); "
                      "python -m phaze_opt.hardware.calibrate --fit --write",
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
    parser = argparse.ArgumentParser(prog="python -m phaze_opt.hardware.calibrate", description=__doc__.splitlines()[0])
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
