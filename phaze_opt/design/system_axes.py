"""The cluster as a search-space axis: which scale-up domain, network and device count a point trains on.

A space may sample these beside the die's and the recipe's axes (`design/space.py`); each names one
choice of `system.System`, and a point's cluster is the study's system (`--system`, the base) with
them replaced (`system_for`). What a space does not sample stays the base's: link latencies, the
global batch, the optimizer accounting and the fitted efficiency fractions, which apply to the new
links as to the base's (the axes give datasheet bandwidths, as a system file does).

    accelerators        devices in the cluster
    devices_per_node    the scale-up domain (NVLink-class: 8 in a DGX B200, 72 in a GB200 NVL72)
    intra_node_gbps     its bandwidth per device and direction, GB/s (NVLink 5: 900)
    nics_per_device     scale-out NICs per device (DGX B200 and GB200 NVL72: 1); a node holds
                        nics_per_device x devices_per_node of them, so one choice means the same
                        thing at every domain size
    nic_gbps            one NIC's bandwidth per direction, GB/s (ConnectX-7 400 Gbit/s: 50)

The cost side of each choice is `hardware/cost.py` (the `cost` objective; sources in docs/frontier.md).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

from ..configs import Limit
from ..errors import shown
from ..system import IDENTITY_EFFICIENCY, LIMITS, Link, System

# The fastest per-device link any of them has been built with is ~1.8 TB/s (NVLink 6 on Rubin, per
# direction); a NIC, 200 GB/s (1.6 Tbit/s). 100 TB/s is far beyond both.
MAX_LINK_GBPS = 100_000.0
SYSTEM_LIMITS = {
    "accelerators": LIMITS["accelerators"],
    "devices_per_node": LIMITS["devices_per_node"],
    "intra_node_gbps": Limit(MAX_LINK_GBPS, "far beyond any link built, ~1.8 TB/s per direction"),
    "nics_per_device": Limit(8, "8 NICs per device, beyond any node built"),
    "nic_gbps": Limit(MAX_LINK_GBPS, "far beyond any NIC built, ~200 GB/s"),
}
SYSTEM_FIELDS = tuple(SYSTEM_LIMITS)
INT_SYSTEM_FIELDS = ("accelerators", "devices_per_node")
GBPS = 1e9  # the axes' bandwidths are in GB/s; the System's in bytes/s


def check_value(name: str, value: Any) -> int | float:
    """A system axis's choice as the space keeps it; a ValueError saying what is allowed otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"values must be positive numbers, got {shown(value)}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if name in INT_SYSTEM_FIELDS and not isinstance(value, int):
        raise ValueError(f"values must be positive integers, got {shown(value)}")
    problem = SYSTEM_LIMITS[name].exceeded(value)
    if problem:
        raise ValueError(problem)
    return value


def base_values(system: System) -> dict[str, int | float]:
    """Every system axis's value in `system` (its datasheet links, before the efficiency fractions)."""
    return {"accelerators": system.accelerators, "devices_per_node": system.devices_per_node,
            "intra_node_gbps": _native(system.nominal_intra_node.bandwidth / GBPS),
            "nics_per_device": _native(system.nics / system.devices_per_node),
            "nic_gbps": _native(system.nominal_inter_node.bandwidth * system.devices_per_node / system.nics / GBPS)}


def _native(v: float) -> int | float:
    r = round(v, 9)
    return int(r) if float(r).is_integer() else r


def system_problem(values: Mapping[str, Any], base: System) -> str:
    """Why the axes' `values` over `base` name no cluster ("" when they do): the rules a system file's
    loading checks (`system.system_from_dict`), said of the axes."""
    if base.torus is not None:
        return (f"system '{base.name}' is a torus, whose shape sets its slice; the system axes "
                f"({', '.join(values)}) need a system of nodes")
    v = {**base_values(base), **values}
    nics = v["nics_per_device"] * v["devices_per_node"]
    if not math.isclose(nics, round(nics), rel_tol=1e-9) or round(nics) < 1:
        return (f"system: nics_per_device {v['nics_per_device']:g} x devices_per_node {v['devices_per_node']} "
                f"is {nics:g} NICs a node, not a whole number")
    if v["devices_per_node"] > v["accelerators"]:
        return f"system: devices_per_node {v['devices_per_node']} exceeds the {v['accelerators']} accelerators"
    # The placement DP's pruning of data-parallel degrees relies on the node's link being the faster
    # one (system.system_from_dict); a device's NIC share is what it gets when all of them send.
    # Compared as achieved, after the base's efficiency fractions, as a system file's links are.
    share = v["nics_per_device"] * v["nic_gbps"]
    eff = base.efficiency
    if share * eff.inter_node_bandwidth > v["intra_node_gbps"] * eff.intra_node_bandwidth * (1 + 1e-9):
        return (f"system: a device's NIC share, nics_per_device x nic_gbps = {share:g} GB/s, exceeds its "
                f"intra_node_gbps {v['intra_node_gbps']:g} GB/s (achieved, after {base.name}'s efficiency "
                "fractions; the scale-up link must be the faster)")
    return ""


def system_for(values: Mapping[str, Any], base: System) -> System:
    """`base` with the axes' `values` (a point's system fields) in place of its own; a ValueError with
    `system_problem`'s reason when they name no cluster."""
    if not values:
        return base
    why = system_problem(values, base)
    if why:
        raise ValueError(why)
    v = {**base_values(base), **values}
    dpn = int(v["devices_per_node"])
    nics = int(round(v["nics_per_device"] * dpn))
    nominal = replace(
        base, name=f"{base.name}[{label(values)}]", accelerators=int(v["accelerators"]), devices_per_node=dpn,
        intra_node=Link(float(v["intra_node_gbps"]) * GBPS, base.intra_node.latency),
        inter_node=Link(float(v["nic_gbps"]) * GBPS * nics / dpn, base.inter_node.latency),
        nics_per_node=0 if nics == dpn else nics, efficiency=IDENTITY_EFFICIENCY, path="")
    return nominal.with_efficiency(base.efficiency)


SHORT = {"accelerators": "n", "devices_per_node": "dpn", "intra_node_gbps": "su", "nics_per_device": "nic",
         "nic_gbps": "nicbw"}


def label(values: Mapping[str, Any]) -> str:
    """A short name of the axes' values, in a point's system name (`dpn72,su1800,n16384`)."""
    return ",".join(f"{SHORT[k]}{values[k]:g}" for k in SYSTEM_FIELDS if k in values)


def summary(system: System) -> dict:
    """What a trial records of its cluster (`system.<field>` in MLflow): the axes' values, datasheet."""
    return {"name": system.name, **base_values(system)}
