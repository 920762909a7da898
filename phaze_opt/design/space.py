"""Search spaces: which accelerators (and which microbatch/recompute choices) a study may try.

A space file (`configs/spaces/<name>.yaml` or the user's own) names every parameter and its ordered
choices, the values that are tied to another parameter or fixed, and the area rule:

    name: phaze
    params:                          # sampled, in this order; choices keep their order
      num_tc: {pow2: [1, 4096]}      # powers of two from 1 to 4096
      glb_mib: {pow2: [2, 128]}
      hbm_gib: [32, 64, 80]          # an explicit list
      mbs: [1, 2, 4, 8]
      recompute: [false, true]
      ...
    tied: {vc_width: tc_x}           # the published system ties the vector width to the TC width
    fixed: {clock_ghz: 1.05}
    hbm_bw_gbps: {32: 1200, ...}     # optional; default hardware.memory.HBM_BW_BY_GIB
    glb_bw_gbps: 8601.6              # optional; default the published rule (hardware.memory)
    area:
      budget: tpuv4                  # a reference design (its modelled area) or a number in mm^2
      min_fraction: 0.3              # the floor, as a fraction of the budget
      floor_exempt_if_one: [num_tc, num_vc]

Every accelerator field (num_tc, tc_x, tc_y, num_vc, vc_width, glb_mib, hbm_gib, clock_ghz) must be
sampled, tied or fixed, and `mbs` and `recompute` must be sampled (a one-item list fixes them).
`recompute` choices are true/false (read as full/none) or none, selective, full. The further
recipe fields (the rest of `Training`) may be sampled too; a space without one trains with its default:
`sequence_parallel` [false, true], `virtual_stages` (positive integers), `zero` [0, 1, 2, 3],
`overlap_grad_reduce` [false, true], `attention` [unfused, flash] (absent: the model's own),
`optimizer_state` [fp32-adam, bf16-moments, bf16-adamw] (absent: the system's own accounting),
`precision` [bf16, fp8, mxfp8, nvfp4] (the GEMM format; workload/precision.py).

`tc_datatypes` (optional, sampled only) is the tensor cores' set of number formats, each choice
a `+`-joined set that starts with bf16, e.g. [bf16, bf16+fp8]: the formats run at their published
rates over BF16 (`DATATYPE_RATES`: FP8 and MXFP8 2x as on Hopper and Blackwell, NVFP4 4x as on
Blackwell) and their datapath counts in the area (hardware/area.py `datatype_fraction`). With both
it and `precision` sampled, a study answers whether a format is worth its area: a point asking for
a format its chip lacks is infeasible. Absent: BF16 only.

The cluster may be sampled too (design/system_axes.py; docs/frontier.md): `accelerators`,
`devices_per_node` (the scale-up domain), `intra_node_gbps` (its bandwidth per device), `nics_per_device`
and `nic_gbps`; a point's cluster is the study's system with them (`system(point, base)`). Absent:
the study's system. `reference_recipes: {model: {field: value}}` (optional) names the published
recipe each model's baseline runs, instead of the best of every recipe the space offers.
`tc_fp8_any_layout: true` (optional) says the template's tensor cores read an FP8 operand in either
major order, as archs/b200.yaml's do, for every design of the space.

The area rule is the published system's (msr-fiddle/phaze, Estimator/architecture.py,
`check_if_acc_to_explore`): a design fits when `min_fraction * budget <= area <= budget`, and the
floor is waived when any of `floor_exempt_if_one` is 1 (single-core designs are kept as baselines).
HBM is off-chip and does not count towards the area.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .. import configs
from ..errors import PhazeError, config_error, shown
from ..hardware.accelerator import Accelerator
from ..hardware.arch import GIB, LIMITS, MIB, load_arch
from ..hardware.area import area_mm2, area_mm2_arrays, datatype_fraction
from ..hardware.memory import HBM_BW_BY_GIB, glb_bandwidth
from ..system import MBS_LIMIT, System, load_system
from ..training import FIELDS, OPTIONAL_FIELDS, SAMPLED_FIELDS, file_value
from . import system_axes
from .system_axes import SYSTEM_FIELDS

ARCH_FIELDS = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_mib", "hbm_gib", "clock_ghz")
AREA_FIELDS = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_mib")  # what the area depends on
RUN_FIELDS = SAMPLED_FIELDS  # the training recipe's fields a space samples (training.py)
RECIPE_FIELDS = OPTIONAL_FIELDS  # further recipe fields a space may sample; absent: the Training default
INT_FIELDS = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "mbs")
# Each core's array is power-of-two (Phaze's template); their counts need not be (a B200 has 148 SMs).
POW2_FIELDS = ("tc_x", "tc_y", "vc_width")
DATATYPE_FIELD = "tc_datatypes"  # optional, sampled: the tensor cores' number formats (module docstring)
# MACs per PE per cycle over BF16 of each format a space's datatype set names: the published ratios
# (H100 SXM datasheet: 1979 dense FP8 vs 989 BF16 TFLOP/s; NVIDIA Blackwell datasheet (B200): FP8
# and MXFP8 2x, NVFP4 4x the dense BF16 rate).
DATATYPE_RATES = {"bf16": 1.0, "fp8": 2.0, "mxfp8": 2.0, "nvfp4": 4.0}
ALL_FIELDS = ARCH_FIELDS + (DATATYPE_FIELD,) + RUN_FIELDS + RECIPE_FIELDS + SYSTEM_FIELDS
# Every choice stays within the reference architectures' limits (hardware.arch.LIMITS); a
# microbatch is part of one global batch, so it has the global batch's limit.
FIELD_LIMITS = {**LIMITS, "mbs": MBS_LIMIT}
TOP_KEYS_REQUIRED = ("params", "area")
TOP_KEYS_OPTIONAL = ("name", "description", "tied", "fixed", "hbm_bw_gbps", "glb_bw_gbps", "reference_recipes",
                     "tc_fp8_any_layout")
AREA_TOLERANCE = 1e-9  # relative; the budget design itself must pass
MAX_GRID = 20_000_000  # points `grid_points` lists one by one (the unpruned sweep)
# Architectures (the product of the area parameters' choices) the grid's arrays hold: a few float
# arrays of this length, about 1 GB in all.
MAX_AREA_CELLS = 20_000_000


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and (v & (v - 1)) == 0


def _native(v):
    """Plain Python numbers: whole floats become ints so points print and log cleanly."""
    if isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def datatype_set(text: str) -> tuple:
    """A space's datatype-set choice ("bf16+fp8") as `Accelerator.tc_datatypes` pairs at `DATATYPE_RATES`;
    a ValueError saying what is allowed otherwise."""
    names = [n.strip().lower() for n in str(text).split("+")]
    if not names or names[0] != "bf16" or any(n not in DATATYPE_RATES for n in names) or len(set(names)) != len(names):
        raise ValueError(f"must be formats joined by '+', starting with bf16 (formats: {', '.join(DATATYPE_RATES)}), "
                         f"got {text!r}")
    return tuple((n, DATATYPE_RATES[n]) for n in names)


def _check_value(file, where: str, name: str, v) -> Any:
    if name == DATATYPE_FIELD:
        try:
            datatype_set(v)
        except ValueError as exc:
            raise config_error(file, where, f"choices {exc}") from None
        return str(v)
    if name in SYSTEM_FIELDS:  # the cluster's axes (design/system_axes.py)
        try:
            return system_axes.check_value(name, v)
        except ValueError as exc:
            raise config_error(file, where, str(exc)) from None
    if name in RECIPE_FIELDS or name == "recompute":  # checked by the recipe's declaration (training.file_value)
        try:
            return file_value(name, v)
        except PhazeError as exc:
            raise config_error(file, where, f"choices: {exc}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise config_error(file, where, f"values must be positive numbers, got {shown(v)}")
    v = _native(v)
    if name in INT_FIELDS and not isinstance(v, int):
        raise config_error(file, where, f"values must be positive integers, got {shown(v)}")
    if name in POW2_FIELDS and not _is_pow2(v):
        raise config_error(file, where, f"values must be powers of two, got {shown(v)}")
    _check_limit(file, where, name, v)
    return v


def _recipe_value(name: str, value):
    """A recipe value as the space holds its choices (a list of modules read back from JSON is the
    tuple the declaration makes of it); other values as they are."""
    if name in RECIPE_FIELDS and isinstance(value, list):
        try:
            return file_value(name, value)
        except PhazeError:
            return value
    return value


def _check_limit(file, where: str, name: str, v) -> None:
    problem = FIELD_LIMITS[name].exceeded(v) if name in FIELD_LIMITS else None
    if problem:
        raise config_error(file, where, problem)


def _expand_choices(file, name: str, spec) -> list:
    where = f"params.{name}"
    if isinstance(spec, dict):
        if set(spec) == {"pow2"}:
            lohi = spec["pow2"]
            if not (isinstance(lohi, list) and len(lohi) == 2 and all(_is_pow2(x) for x in lohi)) or lohi[0] > lohi[1]:
                raise config_error(file, where, f"pow2 needs [low, high] with powers of two, low <= high, got {shown(lohi)}")
            _check_limit(file, where, name, lohi[1])  # before expanding
            values = [2**i for i in range(int(math.log2(lohi[0])), int(math.log2(lohi[1])) + 1)]
        elif set(spec) in ({"range"}, {"range", "step"}):
            lohi, step = spec["range"], spec.get("step", 1)
            ok = isinstance(lohi, list) and len(lohi) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in lohi)
            if not ok or lohi[0] > lohi[1] or not (isinstance(step, int) and not isinstance(step, bool) and step > 0):
                raise config_error(file, where, f"range needs [low, high] integers with low <= high and a positive integer step, got {shown(spec)}")
            _check_limit(file, where, name, lohi[1])  # before expanding
            values = list(range(lohi[0], lohi[1] + 1, step))
        else:
            raise config_error(file, where, f"a mapping must be {{pow2: [low, high]}} or {{range: [low, high], step: s}}, got keys {sorted(spec)}")
    elif isinstance(spec, list):
        values = spec
    else:
        raise config_error(file, where, f"must be a list of choices or a pow2/range mapping, got {shown(spec)}")
    if not values:
        raise config_error(file, where, "has no choices")
    values = [_check_value(file, where, name, v) for v in values]
    if len(set(values)) != len(values):
        raise config_error(file, where, f"repeats a choice: {values}")
    return values


@dataclass
class SearchSpace:
    name: str
    params: dict[str, list]  # sampled parameters -> ordered choices
    tied: dict[str, str]  # field -> the sampled parameter it copies
    fixed: dict[str, Any]
    hbm_bw_table: dict  # hbm GiB -> bytes/s
    glb_bw_fixed: float | None  # bytes/s, or None for the published rule
    area_budget_mm2: float
    budget_label: str
    min_fraction: float
    floor_exempt_if_one: tuple[str, ...]
    description: str = ""
    path: str = ""
    # model -> the published recipe its baseline runs (point values of the recipe fields); a model
    # not named here is baselined at the best recipe of the space (search/objective.compute_baselines)
    reference_recipes: dict = field(default_factory=dict)
    # the template's tensor cores read an FP8 operand in either major order (archs/b200.yaml; one
    # FP8 weight copy, not two: workload/precision.py); the same for every design of the space
    tc_fp8_any_layout: bool = False
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- single points --------------------------------------------------------------------------

    def _value(self, point: dict, name: str):
        if name in self.fixed:
            return self.fixed[name]
        if name in self.tied:
            name = self.tied[name]
        try:
            return point[name]
        except KeyError:
            raise PhazeError(f"space '{self.name}': point lacks parameter '{name}'; it needs {', '.join(self.params)}") from None

    def arch_values(self, point: dict) -> dict:
        """Every accelerator field in config units (MiB, GiB, GHz) for a point."""
        return {f: self._value(point, f) for f in ARCH_FIELDS}

    def accelerator(self, point: dict) -> Accelerator:
        v = self.arch_values(point)
        clock_hz = float(v["clock_ghz"]) * 1e9
        hbm = v["hbm_gib"]
        if hbm not in self.hbm_bw_table:
            raise PhazeError(f"space '{self.name}': no HBM bandwidth for hbm_gib={hbm}; known {sorted(self.hbm_bw_table)}")
        glb_bw = self.glb_bw_fixed if self.glb_bw_fixed is not None else glb_bandwidth(
            v["num_tc"], v["tc_x"], v["tc_y"], v["num_vc"], v["vc_width"], clock_hz)
        label = (f"tc{v['num_tc']}x{v['tc_x']}x{v['tc_y']}-vc{v['num_vc']}x{v['vc_width']}"
                 f"-glb{_native(v['glb_mib'])}M-hbm{_native(hbm)}G")
        return Accelerator(
            num_tc=int(v["num_tc"]), tc_x=int(v["tc_x"]), tc_y=int(v["tc_y"]), num_vc=int(v["num_vc"]),
            vc_width=int(v["vc_width"]), glb_bytes=int(round(v["glb_mib"] * MIB)), glb_bw=float(glb_bw),
            hbm_bytes=int(round(hbm * GIB)), hbm_bw=float(self.hbm_bw_table[hbm]), clock_hz=clock_hz, name=label,
            **({"tc_datatypes": datatype_set(point[DATATYPE_FIELD])} if DATATYPE_FIELD in self.params else {}),
            tc_fp8_any_layout=self.tc_fp8_any_layout,
        )

    @property
    def system_params(self) -> list[str]:
        """The cluster's axes this space samples (design/system_axes.py); none: the study's system."""
        return [p for p in self.params if p in SYSTEM_FIELDS]

    def system(self, point: dict, base: System | str) -> System:
        """The cluster a point trains on: `base` (the study's system) with the point's system axes.
        A ValueError with the reason when they name no cluster (`system_problem`)."""
        base = load_system(base)
        return system_axes.system_for({p: point[p] for p in self.system_params}, base)

    def system_problem(self, point: dict, base: System | str) -> str:
        """Why a point's system axes over `base` name no cluster ("" when they do, or it has none)."""
        if not self.system_params:
            return ""
        return system_axes.system_problem({p: point[p] for p in self.system_params}, load_system(base))

    def constant_arch_fields(self) -> dict:
        """The accelerator fields (`Accelerator.fields()`) every point of the space shares.

        From the definition, not from sampled designs: a field is constant when every space field it
        is built from is fixed, or tied to or sampled from a parameter with one choice.
        """
        def varies(f):
            if f in self.fixed:
                return False
            return len(self.params.get(self.tied.get(f, f), ())) > 1

        glb_bw_from = () if self.glb_bw_fixed is not None else ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width",
                                                                "clock_ghz")
        sources = {**{f: (f,) for f in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width")},
                   "glb_bytes": ("glb_mib",), "glb_bw": glb_bw_from, "hbm_bytes": ("hbm_gib",),
                   "hbm_bw": ("hbm_gib",), "clock_hz": ("clock_ghz",), "name": ARCH_FIELDS,
                   DATATYPE_FIELD: (DATATYPE_FIELD,), "tc_fp8_any_layout": ()}
        fields = self.accelerator({p: choices[0] for p, choices in self.params.items()}).fields()
        return {k: v for k, v in fields.items() if not any(varies(f) for f in sources[k])}

    def _rule(self, area, exempt):
        """Vectorised area rule -> (ok, too_big, too_small)."""
        too_big = area > self.area_budget_mm2 * (1 + AREA_TOLERANCE)
        too_small = (area < self.min_fraction * self.area_budget_mm2 * (1 - AREA_TOLERANCE)) & ~exempt
        return ~too_big & ~too_small, too_big, too_small

    def area_check(self, point: dict) -> tuple[bool, float, str]:
        """(fits, area in mm^2, why not) for one point; the reason is '' when it fits."""
        acc = self.accelerator(point)
        area = area_mm2(acc)
        exempt = np.array(any(self._value(point, f) == 1 for f in self.floor_exempt_if_one))
        ok, too_big, _ = self._rule(np.array(area), exempt)
        if ok:
            return True, area, ""
        if too_big:
            return False, area, f"area {area:.1f} mm^2 exceeds the {self.area_budget_mm2:.1f} mm^2 budget ({self.budget_label})"
        floor = self.min_fraction * self.area_budget_mm2
        waiver = f"; waived only when {' or '.join(self.floor_exempt_if_one)} is 1" if self.floor_exempt_if_one else ""
        return False, area, (f"area {area:.1f} mm^2 is below the {floor:.1f} mm^2 floor ({self.min_fraction:g} of the "
                             f"{self.area_budget_mm2:.1f} mm^2 budget{waiver})")

    # ---- the grid -------------------------------------------------------------------------------

    @property
    def area_params(self) -> list[str]:
        """Sampled parameters that change the chip's area (directly or through a tie)."""
        used = {self.tied.get(f, f) for f in AREA_FIELDS if f not in self.fixed} | {DATATYPE_FIELD}
        return [p for p in self.params if p in used]

    def _grid_arrays(self):
        """Over the index grid of the area parameters alone (one array axis each, in file order): the
        area and the feasibility mask. The other parameters leave both unchanged, and leaving them out
        keeps a space of many recipe and system axes within numpy's 32 array dimensions."""
        if "grid" in self._cache:
            return self._cache["grid"]
        names = self.area_params
        shape = tuple(len(self.params[n]) for n in names)
        cells = math.prod(shape)
        if cells > MAX_AREA_CELLS:  # checked before the arrays below are allocated
            raise PhazeError(f"space '{self.name}': its area parameters ({', '.join(names)}) "
                             f"make {cells:,} architectures, more than the {MAX_AREA_CELLS:,} this tool holds; "
                             "give fewer choices")

        def along(src, values):
            k = names.index(src)
            return np.array(values, dtype=float).reshape([-1 if i == k else 1 for i in range(len(names))])

        def axis_values(field_name):
            if field_name in self.fixed:
                return np.array(self.fixed[field_name], dtype=float)
            src = self.tied.get(field_name, field_name)
            return along(src, self.params[src])

        v = {f: axis_values(f) for f in AREA_FIELDS}
        datatypes = 0.0
        if DATATYPE_FIELD in self.params:  # the extra PE area of each datatype set, on its own axis
            datatypes = along(DATATYPE_FIELD, [datatype_fraction(datatype_set(c)) for c in self.params[DATATYPE_FIELD]])
        area = area_mm2_arrays(v["num_tc"], v["tc_x"], v["tc_y"], v["num_vc"], v["vc_width"], v["glb_mib"] * MIB,
                               datatypes=datatypes)
        area = np.broadcast_to(area, shape)
        exempt = np.zeros(shape, dtype=bool)
        for f in self.floor_exempt_if_one:
            exempt = exempt | (axis_values(f) == 1)
        ok, _, _ = self._rule(area, exempt)
        self._cache["grid"] = (names, shape, area, ok)
        return self._cache["grid"]

    def _arch_grid(self):
        """Area-relevant sub-grid: (names, index arrays of the feasible combos in grid order, areas)."""
        if "arch" in self._cache:
            return self._cache["arch"]
        names, shape, area, ok = self._grid_arrays()
        idx = np.nonzero(ok.reshape(shape or (1,)))
        result = (names, idx, area.reshape(shape or (1,))[idx])
        self._cache["arch"] = result
        return result

    def count(self) -> int:
        """Number of architectures (distinct area-relevant choices) that pass the area rule."""
        return int(self._arch_grid()[2].size)

    def architectures(self, order: str = "area") -> list[dict]:
        """The area-feasible architectures as dicts of the area-relevant parameters plus `area_mm2`."""
        names, idx, areas = self._arch_grid()
        perm = self._order(areas, order)
        cols = [[self.params[n][j] for j in idx[k][perm]] for k, n in enumerate(names)]
        rows = zip(*cols) if names else [()] * areas.size
        return [dict(zip(names, vals), area_mm2=float(a)) for vals, a in zip(rows, areas[perm])]

    def dies(self, order: str = "grid") -> list[dict]:
        """Every die a point can name but its HBM: the area-feasible architectures crossed with the
        sampled chip fields that cost no area (the clock), each with its `area_mm2`. The exhaustive
        sweep and the bound order walk these; `architectures` alone would leave such a field out."""
        free = [f for f in ARCH_FIELDS if f in self.params and f != "hbm_gib" and f not in self.area_params]
        archs = self.architectures(order)
        for name in free:
            archs = [{**a, name: v} for a in archs for v in self.params[name]]
        return archs

    @staticmethod
    def _order(areas: np.ndarray, order: str) -> np.ndarray:
        if order == "grid":
            return np.arange(areas.size)
        if order == "area":  # the published sweep: largest designs first
            return np.argsort(-areas, kind="stable")
        raise ValueError(f"order must be 'area' or 'grid', got {shown(order)}")

    def grid_points(self, order: str = "area") -> list[dict]:
        """Every area-feasible full point (all sampled parameters).

        "grid": the product of the choices in file order; "area": by decreasing area, the published
        system's sweep order, ties in grid order.
        """
        names = list(self.params)
        shape = tuple(len(self.params[n]) for n in names)
        if math.prod(shape) > MAX_GRID:  # a list of dicts this long would not fit in memory
            raise PhazeError(f"space '{self.name}': {math.prod(shape):,} grid cells is more than the {MAX_GRID:,} "
                             "this tool lists point by point (the pruned sweep enumerates architectures x recipes "
                             "itself; use --prune bound where its bounds apply, else sample the space without "
                             "--exhaustive)")
        area_names, area_shape, area, ok = self._grid_arrays()
        # every cell's index per parameter, in grid (C) order, and its area cell's flat index
        full = np.indices(shape, dtype=np.int32).reshape(len(names), -1) if names else np.zeros((0, 1), dtype=int)
        cell = (np.ravel_multi_index(tuple(full[names.index(n)] for n in area_names), area_shape)
                if area_names else np.zeros(full.shape[1], dtype=int))
        keep = np.nonzero(ok.reshape(-1)[cell])[0]
        if keep.size == 0:
            return []
        perm = self._order(area.reshape(-1)[cell[keep]], order)
        chosen = keep[perm]
        cols = [[self.params[n][j] for j in full[k][chosen]] for k, n in enumerate(names)]
        return [dict(zip(names, vals)) for vals in zip(*cols)]

    def size(self) -> int:
        """Number of area-feasible full points (what `grid_points` returns)."""
        # Area depends only on the area axes: count those cells and multiply by the other axes' choices
        # (no product-sized array, so a space may list every recipe field with all its choices).
        return self.count() * math.prod(len(c) for n, c in self.params.items() if n not in self.area_params)

    # ---- reference designs ----------------------------------------------------------------------

    def recipe_point(self, recipe: Mapping[str, Any]) -> dict:
        """The space's recipe fields as `recipe` sets them; a field it leaves out takes the `Training`
        default where the space offers it, else the space's first choice (recompute: "none" or off
        where offered). A one-line error when the space does not offer a value `recipe` names."""
        point = {}
        for p in self.params:
            if p in recipe:
                value = _recipe_value(p, recipe[p])
                if value not in self.params[p]:
                    raise PhazeError(f"space '{self.name}' offers no {p} {recipe[p]!r} (choices: {self.params[p]})")
                point[p] = value
            elif p == "mbs":
                point[p] = self.params["mbs"][0]
            elif p == "recompute":
                point[p] = next((c for c in self.params[p] if c is False or c == "none"), self.params[p][0])
            elif p in RECIPE_FIELDS:
                default = FIELDS[p].default
                point[p] = default if default in self.params[p] else self.params[p][0]
        return point

    def reference_point(self, arch: str | os.PathLike = "tpuv4", recipe: Mapping[str, Any] | None = None,
                        system: System | str | None = None) -> dict:
        """The point of this space that builds `arch` (a reference design name or path) in `system`
        (the cluster; needed when the space samples system axes), trained by `recipe` (point values
        of the space's recipe fields, e.g. a `Baseline.recipe` with its mbs and recompute); a recipe
        field it leaves out takes the `Training` default where the space offers it, else the space's
        first choice (recompute: "none" or off where offered).

        Fails with a one-line error when the space cannot express the design (a fixed or tied field,
        or a derived bandwidth, differs), the cluster, or the recipe (a value the space does not offer).
        """
        acc = load_arch(arch)
        recipe = dict(recipe or {})
        if self.system_params and system is None:
            raise PhazeError(f"space '{self.name}' samples the cluster ({', '.join(self.system_params)}): "
                             "its reference point needs the reference system")
        cluster = system_axes.base_values(load_system(system)) if self.system_params else {}
        have = {
            "num_tc": acc.num_tc, "tc_x": acc.tc_x, "tc_y": acc.tc_y, "num_vc": acc.num_vc, "vc_width": acc.vc_width,
            "glb_mib": _native(acc.glb_bytes / MIB), "hbm_gib": _native(acc.hbm_bytes / GIB),
            "clock_ghz": _native(acc.clock_hz / 1e9),
        }
        point = self.recipe_point(recipe)
        for p in self.params:
            if p in point:
                continue
            if p == DATATYPE_FIELD:  # the design's own set where the space offers it
                own = "+".join(acc.datatype_names)
                if own not in self.params[p]:
                    raise PhazeError(f"space '{self.name}' cannot express arch '{acc.name}': its tensor cores' "
                                     f"formats {own} are not among {self.params[p]}")
                point[p] = own
            elif p in SYSTEM_FIELDS:
                if cluster[p] not in self.params[p]:
                    raise PhazeError(f"space '{self.name}' cannot express system '{load_system(system).name}': its "
                                     f"{p} {cluster[p]:g} is not among {self.params[p]}")
                point[p] = cluster[p]
            else:
                point[p] = have[p]
        point = {p: point[p] for p in self.params}  # in the space's order

        def cannot(why):
            return PhazeError(f"space '{self.name}' cannot express arch '{acc.name}': {why}")

        for f, v in self.fixed.items():
            if not math.isclose(have[f], v, rel_tol=1e-9):
                raise cannot(f"{f} is fixed at {v} in the space, the design has {have[f]}")
        for f, src in self.tied.items():
            if have[f] != have[src]:
                raise cannot(f"{f} is tied to {src} in the space, the design has {f}={have[f]}, {src}={have[src]}")
        if acc.tc_fp8_any_layout != self.tc_fp8_any_layout:
            raise cannot(f"its tc_fp8_any_layout is {str(acc.tc_fp8_any_layout).lower()}, the space's "
                         f"{str(self.tc_fp8_any_layout).lower()}")
        if have["hbm_gib"] not in self.hbm_bw_table:
            raise cannot(f"the space knows no HBM bandwidth for {have['hbm_gib']} GiB (known: {sorted(self.hbm_bw_table)})")
        built = self.accelerator(point)
        for f in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes", "glb_bw", "hbm_bytes", "hbm_bw", "clock_hz"):
            a, b = getattr(built, f), getattr(acc, f)
            if not math.isclose(a, b, rel_tol=1e-9):
                raise cannot(f"{f} would be {a:g} in the space, the design has {b:g}")
        return point


def _parse_budget(file, area_spec) -> tuple[float, str]:
    budget = area_spec.get("budget")
    if isinstance(budget, str):
        base = Path(file).parent
        candidate = base / budget
        target = candidate if (budget.endswith((".yaml", ".yml")) and candidate.is_file()) else budget
        try:
            acc = load_arch(target)
        except PhazeError as exc:
            raise config_error(file, "area.budget", f"not a reference design ({exc})") from None
        return area_mm2(acc), acc.name or str(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise config_error(file, "area.budget", f"must be a reference design name or a positive number of mm^2, got {shown(budget)}")
    return float(budget), f"{budget:g} mm^2"


def _reference_recipes(file, raw, params: dict) -> dict:
    """The optional `reference_recipes: {model: {field: value}}`, each value one of the space's
    choices of a recipe field it samples (a published recipe the space can express)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(m, str) and isinstance(r, dict) for m, r in raw.items()):
        raise config_error(file, "reference_recipes", f"must map a model name to a mapping of recipe fields, got {shown(raw)}")
    out = {}
    for model, recipe in raw.items():
        checked = {}
        for f, v in recipe.items():
            where = f"reference_recipes.{model}.{f}"
            if f not in params or f not in RUN_FIELDS + RECIPE_FIELDS:
                sampled = [p for p in params if p in RUN_FIELDS + RECIPE_FIELDS]
                raise config_error(file, where, f"not a recipe field the space samples; it samples {', '.join(sampled)}")
            value = _check_value(file, where, f, v)
            if value not in params[f]:
                raise config_error(file, where, f"must be one of the space's choices {params[f]}, got {shown(v)}")
            checked[f] = value
        out[model] = checked
    return out


def space_from_mapping(data: dict, file, default_name: str = "") -> SearchSpace:
    configs.check_keys(data, file, TOP_KEYS_REQUIRED, TOP_KEYS_OPTIONAL)
    raw_params = data["params"]
    if not isinstance(raw_params, dict) or not raw_params:
        raise config_error(file, "params", "must be a non-empty mapping of parameter -> choices")
    for name in raw_params:
        if name not in ALL_FIELDS:
            raise config_error(file, f"params.{name}", f"unknown parameter; allowed: {', '.join(ALL_FIELDS)}")
    params = {name: _expand_choices(file, name, spec) for name, spec in raw_params.items()}

    tied = data.get("tied") or {}
    fixed_raw = data.get("fixed") or {}
    for key, val in (("tied", tied), ("fixed", fixed_raw)):
        if not isinstance(val, dict):
            raise config_error(file, key, f"must be a mapping, got {shown(val)}")
    for f, src in tied.items():
        if f not in ARCH_FIELDS:
            raise config_error(file, f"tied.{f}", f"unknown field; allowed: {', '.join(ARCH_FIELDS)}")
        if src not in params or src in RUN_FIELDS or src in RECIPE_FIELDS or src in SYSTEM_FIELDS:
            raise config_error(file, f"tied.{f}", f"must name a sampled accelerator parameter, got {shown(src)}")
    fixed = {}
    for f, v in fixed_raw.items():
        if f not in ARCH_FIELDS:
            raise config_error(file, f"fixed.{f}", f"unknown field; allowed: {', '.join(ARCH_FIELDS)}")
        fixed[f] = _check_value(file, f"fixed.{f}", f, v)
    for f in ARCH_FIELDS:
        where = [k for k, d in (("params", params), ("tied", tied), ("fixed", fixed)) if f in d]
        if len(where) != 1:
            problem = "is not given" if not where else f"is given in more than one of {', '.join(where)}"
            raise config_error(file, f, f"{problem}; every accelerator field must be sampled (params), tied or fixed")
    for f in RUN_FIELDS:
        if f not in params:
            raise config_error(file, f"params.{f}", "missing; give the choices (a one-item list fixes it)")

    hbm_raw = data.get("hbm_bw_gbps")
    if hbm_raw is None:
        hbm_table = dict(HBM_BW_BY_GIB)
    else:
        if not isinstance(hbm_raw, dict) or not hbm_raw:
            raise config_error(file, "hbm_bw_gbps", "must map HBM capacity (GiB) -> bandwidth (GB/s)")
        hbm_table = {}
        for k, v in hbm_raw.items():
            hbm_table[_native(k)] = configs.positive_number(hbm_raw, k, file, limit=LIMITS["hbm_bw_gbps"],
                                                            field=f"hbm_bw_gbps.{k}") * 1e9
    hbm_choices = params.get("hbm_gib", [fixed.get("hbm_gib")])
    for h in hbm_choices:
        if h not in hbm_table:
            raise config_error(file, "hbm_bw_gbps", f"no bandwidth for hbm_gib {h}; known: {sorted(hbm_table)}")
    glb_bw = None
    if "glb_bw_gbps" in data:
        glb_bw = configs.positive_number(data, "glb_bw_gbps", file, limit=LIMITS["glb_bw_gbps"]) * 1e9

    area_spec = data["area"]
    if not isinstance(area_spec, dict):
        raise config_error(file, "area", "must be a mapping with budget, min_fraction, floor_exempt_if_one")
    configs.check_keys(area_spec, f"{file}: area", ["budget"], ["min_fraction", "floor_exempt_if_one"])
    budget, label = _parse_budget(file, area_spec)
    min_fraction = area_spec.get("min_fraction", 0.0)
    if isinstance(min_fraction, bool) or not isinstance(min_fraction, (int, float)) or not 0 <= min_fraction < 1:
        raise config_error(file, "area.min_fraction", f"must be a number in [0, 1), got {shown(min_fraction)}")
    exempt = area_spec.get("floor_exempt_if_one", [])
    if not isinstance(exempt, list) or any(e not in ("num_tc", "num_vc") for e in exempt):
        raise config_error(file, "area.floor_exempt_if_one", f"must be a list drawn from num_tc, num_vc, got {shown(exempt)}")

    references = _reference_recipes(file, data.get("reference_recipes"), params)
    any_layout = data.get("tc_fp8_any_layout", False)
    if not isinstance(any_layout, bool):
        raise config_error(file, "tc_fp8_any_layout", f"must be true or false, got {shown(any_layout)}")
    name = data.get("name", default_name)
    if not isinstance(name, str):
        raise config_error(file, "name", f"must be a string, got {shown(name)}")
    space = SearchSpace(
        name=name, params=params, tied=dict(tied), fixed=fixed, hbm_bw_table=hbm_table, glb_bw_fixed=glb_bw,
        area_budget_mm2=budget, budget_label=label, min_fraction=float(min_fraction),
        floor_exempt_if_one=tuple(exempt), description=str(data.get("description", "")), path=str(file),
        reference_recipes=references, tc_fp8_any_layout=any_layout,
    )
    if space.count() == 0:
        raise config_error(file, "area", f"no architecture passes the area rule (budget {budget:.2f} mm^2, "
                                         f"floor {min_fraction:g} of it): the space is empty")
    return space


def load_space(name_or_path: str | os.PathLike) -> SearchSpace:
    data, path = configs.load("spaces", name_or_path)
    return space_from_mapping(data, path, default_name=path.stem)


def available_spaces() -> list[str]:
    return configs.available("spaces")
