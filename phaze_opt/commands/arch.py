"""`phaze-opt arch`: show a reference architecture, or the architectures of a search space."""

from __future__ import annotations

import csv
import io

from ..errors import PhazeError
from ..hardware.arch import load_arch
from ..hardware.area import area_mm2, breakdown
from ..hardware.cost import device_cost
from ..design import system_axes
from ..design.space import load_space
from ..system import load_system

HELP = "show an accelerator (area, peak FLOP/s, fields, cost) or count/list a search space's architectures"
DESCRIPTION = (
    "With --arch: the design's fields, modelled area and peak FLOP/s; with --system too, its cluster's "
    "capital cost (configs/cost.yaml), the system's axes changed by --system-axis. With --space: a summary "
    "of the space; --count prints how many architectures pass its area rule, --csv lists them with their area."
)


def add_arguments(parser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", metavar="NAME|PATH", help="a reference design in presets/archs (or --configs DIR) or a YAML file")
    which.add_argument("--space", metavar="NAME|PATH", help="a search space in presets/spaces (or --configs DIR) or a YAML file")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--count", action="store_true", help="with --space: the number of area-feasible architectures")
    out.add_argument("--csv", action="store_true", help="with --space: list the area-feasible architectures as CSV")
    parser.add_argument("--system", metavar="NAME|PATH",
                        help="with --arch: price the cluster of this system (presets/systems or a YAML file)")
    parser.add_argument("--system-axis", action="append", default=[], metavar="NAME=VALUE",
                        help="with --system: one system axis changed, as a space samples it "
                             f"({', '.join(system_axes.SYSTEM_FIELDS)}); repeatable")


def _arch_result(acc) -> dict:
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


def _axis_values(items) -> dict:
    """`--system-axis NAME=VALUE` flags as the axes' values; a one-line error naming the bad one."""
    values = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in system_axes.SYSTEM_FIELDS:
            raise PhazeError(f"--system-axis {item}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(system_axes.SYSTEM_FIELDS)}")
        try:
            number = float(text)
        except ValueError:
            raise PhazeError(f"--system-axis {item}: VALUE must be a number") from None
        try:
            values[name] = system_axes.check_value(name, number)
        except ValueError as exc:
            raise PhazeError(f"--system-axis {item}: {exc}") from None
    return values


def _cost_result(acc, system_name, items) -> dict:
    """The cluster's capital cost of `acc` on the system, per device by part and in all (hardware/cost.py)."""
    system = load_system(system_name)
    values = _axis_values(items)
    if values:
        try:
            system = system_axes.system_for(values, system)
        except ValueError as exc:
            raise PhazeError(f"--system-axis: {exc}") from None
    per_device = device_cost(acc, system).to_dict()
    return {"system": system.name, "devices": system.accelerators, "per_device_usd": per_device,
            "cluster_usd": per_device["total"] * system.accelerators, "axes": system_axes.summary(system)}


def run(args) -> dict:
    if args.arch is not None:
        if args.count or args.csv:
            raise PhazeError("--count and --csv go with --space, not --arch")
        acc = load_arch(args.arch)
        result = _arch_result(acc)
        if args.system is not None:
            result["cost"] = _cost_result(acc, args.system, args.system_axis)
        elif args.system_axis:
            raise PhazeError("--system-axis goes with --system")
        return result
    if args.system is not None or args.system_axis:
        raise PhazeError("--system and --system-axis go with --arch, not --space")
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
        *_cost_lines(result.get("cost")),
    ])


def _cost_lines(cost: dict | None) -> list[str]:
    if not cost:
        return []
    d = cost["per_device_usd"]
    parts = ", ".join(f"{k.replace('_', '-')} {v:,.0f}" for k, v in d.items() if k != "total")
    return [f"  cost            ${cost['cluster_usd']:,.0f} for {cost['devices']:,} devices on {cost['system']}: "
            f"${d['total']:,.0f} a device ({parts}; configs/cost.yaml)"]
