"""`phaze-opt arch`: show a reference architecture, or the architectures of a search space."""

from __future__ import annotations

import csv
import io

from ..errors import PhazeError
from ..hardware.arch import load_arch
from ..hardware.area import area_mm2, breakdown
from ..design.space import load_space

HELP = "show an accelerator (area, peak FLOP/s, fields) or count/list a search space's architectures"
DESCRIPTION = (
    "With --arch: the design's fields, modelled area and peak FLOP/s. With --space: a summary of the "
    "space; --count prints how many architectures pass its area rule, --csv lists them with their area."
)


def add_arguments(parser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", metavar="NAME|PATH", help="a reference design in presets/archs (or --configs DIR) or a YAML file")
    which.add_argument("--space", metavar="NAME|PATH", help="a search space in presets/spaces (or --configs DIR) or a YAML file")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--count", action="store_true", help="with --space: the number of area-feasible architectures")
    out.add_argument("--csv", action="store_true", help="with --space: list the area-feasible architectures as CSV")


def _arch_result(name_or_path) -> dict:
    acc = load_arch(name_or_path)
    fields = acc.fields()
    return {
        "kind": "arch",
        "name": fields.pop("name"),
        "area_mm2": area_mm2(acc),
        "peak_flops": acc.peak_flops,
        **fields,
        "vc_peak_ops": acc.vc_peak_ops,
        "l2_tc_bytes": acc.l2_tc_bytes,
        "l2_vc_bytes": acc.l2_vc_bytes,
        "area_breakdown_mm2": breakdown(acc),
    }


def run(args) -> dict:
    if args.arch is not None:
        if args.count or args.csv:
            raise PhazeError("--count and --csv go with --space, not --arch")
        return _arch_result(args.arch)
    space = load_space(args.space)
    if args.count:
        return {"kind": "count", "space": space.name, "architectures": space.count(), "points": space.size()}
    if args.csv:
        rows = space.architectures(order="area")
        for row in rows:  # show tied fields too, so each row is a whole design
            for f, src in space.tied.items():
                row[f] = row.get(src)
        return {"kind": "csv", "space": space.name, "architectures": rows}
    return {
        "kind": "space",
        "space": space.name,
        "description": space.description,
        "path": space.path,
        "params": space.params,
        "tied": space.tied,
        "fixed": space.fixed,
        "area_budget_mm2": space.area_budget_mm2,
        "area_budget": space.budget_label,
        "min_fraction": space.min_fraction,
        "floor_exempt_if_one": list(space.floor_exempt_if_one),
        "architectures": space.count(),
        "points": space.size(),
    }


def render(result: dict) -> str:
    kind = result["kind"]
    if kind == "count":
        return str(result["architectures"])
    if kind == "csv":
        rows = result["architectures"]
        if not rows:
            return ""
        buf = io.StringIO()
        keys = [k for k in rows[0] if k != "area_mm2"] + ["area_mm2"]
        writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "area_mm2": f"{row['area_mm2']:.4f}"})
        return buf.getvalue().rstrip("\n")
    if kind == "space":
        lines = [f"space {result['space']}: {result['description']}".rstrip(": "),
                 f"  area budget {result['area_budget_mm2']:.2f} mm^2 ({result['area_budget']}), "
                 f"floor {result['min_fraction']:g} of it, waived when {' or '.join(result['floor_exempt_if_one']) or '-'} is 1"]
        for name, choices in result["params"].items():
            shown = choices if len(choices) <= 8 else [*choices[:3], "...", *choices[-2:]]
            lines.append(f"  {name}: {', '.join(map(str, shown))} ({len(choices)} choices)")
        for f, src in result["tied"].items():
            lines.append(f"  {f} = {src}")
        for f, v in result["fixed"].items():
            lines.append(f"  {f} = {v}")
        lines.append(f"  {result['architectures']} architectures pass the area rule; {result['points']} points in all")
        return "\n".join(lines)
    bd = result["area_breakdown_mm2"]
    eff = result.get("efficiency")  # only a calibrated preset has one (hardware/efficiency.py)
    tail = [f"  efficiency      GEMM tile reuse {eff['gemm_tile_reuse']:g}, wave balance {eff['gemm_wave_balance']:g}, "
            f"tensor cores {eff['tc_fraction']:g}, HBM {eff['hbm_fraction']:g}, {eff['op_overhead_s'] * 1e6:g} us per op"
            ] if eff else []
    return "\n".join([
        f"{result['name']}",
        f"  area            {result['area_mm2']:.2f} mm^2  (GLB {bd['glb_sram']:.1f}, TCs {bd['tensor_cores']:.1f}, "
        f"VCs {bd['vector_cores']:.1f}, local SRAM {bd['local_sram']:.1f}, fixed {bd['fixed']:.2f})",
        f"  peak            {result['peak_flops'] / 1e12:.1f} TFLOP/s (16-bit)",
        f"  tensor cores    {result['num_tc']} x {result['tc_x']}x{result['tc_y']} PEs",
        f"  vector cores    {result['num_vc']} x {result['vc_width']} lanes",
        f"  GLB             {result['glb_bytes'] / 2**20:g} MiB at {result['glb_bw'] / 1e9:.0f} GB/s",
        f"  HBM             {result['hbm_bytes'] / 2**30:g} GiB at {result['hbm_bw'] / 1e9:.0f} GB/s",
        f"  clock           {result['clock_hz'] / 1e9:g} GHz",
        *tail,
    ])
