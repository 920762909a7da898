"""Capital cost of a cluster, in US dollars: what one device and its share of the network cost, times the devices.

A throughput study alone settles every system axis at its top choice (more devices, a larger and
faster scale-up domain, more and faster NICs never train slower); this prices those choices, and the
die's, so a study can weigh them. Constants and their sources live in `configs/cost.yaml`; a number
without a published source is a documented ASSUMPTION there, with the range to try.

One device's share, from the accelerator and the `System` it runs in:

- die: the modelled area A (`hardware/area.py`); gross dies per 300 mm wafer by the standard formula
  with edge loss, pi (d/2)^2 / A - pi d / sqrt(2 A) (Hennessy & Patterson, 6th ed., Sec. 1.6), times
  Murphy's yield ((1 - e^(-A D0)) / (A D0))^2 (Murphy, Proc. IEEE 1964): wafer price / good dies.
  A die no wafer holds a whole copy of costs +inf. The die is priced as one piece of silicon at any
  area (no chiplet split), so a larger die never costs less.
- package (interposer, substrate, assembly, test) and host share (CPUs, DRAM, chassis): fixed per device.
- HBM: its capacity in GiB times a price per GiB.
- scale-out: its NICs (priced per GB/s of bandwidth) and their share of a folded-Clos fat tree of
  k-port switches: a NIC of b GB/s is b / (port GB/s) endpoint ports; a t-tier tree reaches 2 (k/2)^t
  endpoint ports, with 2t - 1 switch ports and t links per endpoint port (Al-Fares et al.,
  SIGCOMM 2008); t is the fewest tiers that reach every NIC port of the cluster.
- scale-up: its links (bandwidth / link GB/s) each take a port on a switch chip, by the same fat-tree
  rule over the domain's devices with the chip's port count (GB200 NVL72 and HGX B200 both come to
  18 links on 1/4 of a 72-port chip per GPU); a domain larger than one baseboard cables every link.
  A domain of one device has no scale-up network; a torus (TPU v4's ICI) links chips directly, so
  its scale-up has no switch or cable priced (its optical circuit switches are not modelled).

Every term is non-decreasing in what it prices (area, HBM, NIC count and speed, domain size and
bandwidth, devices), and none reads the training recipe.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import configs
from ..errors import PhazeError, config_error, shown
from ..system import System
from .accelerator import Accelerator
from .area import area_mm2

GIB = 2**30
GBPS = 1e9  # the constants' bandwidths are GB/s; the System's, bytes/s


@dataclass(frozen=True)
class CostConstants:
    wafer_usd: float
    wafer_diameter_mm: float
    defect_density_per_cm2: float
    package_usd: float
    hbm_usd_per_gib: float
    host_usd_per_device: float
    nic_usd_per_gbps: float
    switch_ports: int
    switch_port_gbps: float
    switch_usd: float
    link_usd: float
    scaleup_link_gbps: float
    scaleup_switch_ports: int
    scaleup_switch_usd: float
    scaleup_board_devices: int
    scaleup_cable_usd_per_link: float


FIELDS = tuple(f.name for f in fields(CostConstants))
# A switch of k ports builds a tree only when k/2 > 1; the rest are counts of at least one.
INT_MINIMUM = {"switch_ports": 4, "scaleup_switch_ports": 4, "scaleup_board_devices": 1}
POSITIVE = ("wafer_diameter_mm", "switch_port_gbps", "scaleup_link_gbps")


def constants_path() -> Path:
    return configs.constants_file("cost.yaml")


def load_constants(path: str | os.PathLike | None = None) -> CostConstants:
    """Read and validate `configs/cost.yaml` (cached per file and modification time)."""
    return configs.load_constants(path if path is not None else constants_path(), "cost constants file not found",
                                  _parse_constants)


def _parse_constants(path: str, data) -> CostConstants:
    if not isinstance(data, dict):
        raise PhazeError(f"{path}: expected a mapping of cost constants at the top level")
    configs.check_keys(data, path, FIELDS)
    values = {}
    for f in FIELDS:
        v = configs.finite_number(data[f], path, f)
        if f in INT_MINIMUM:
            if not v.is_integer() or v < INT_MINIMUM[f]:
                raise config_error(path, f, f"must be a whole number >= {INT_MINIMUM[f]}, got {shown(data[f])}")
            values[f] = int(v)
            continue
        if v < 0 or (f in POSITIVE and v == 0):
            raise config_error(path, f, f"must be {'> 0' if f in POSITIVE else '>= 0'}, got {shown(data[f])}")
        values[f] = v
    return CostConstants(**values)


# ---- the die -----------------------------------------------------------------------------------------


def dies_per_wafer(area: float, c: CostConstants) -> int:
    """Whole dies of `area` mm^2 on one wafer, edge loss included (Hennessy & Patterson, Sec. 1.6)."""
    d = c.wafer_diameter_mm
    gross = math.pi * (d / 2) ** 2 / area - math.pi * d / math.sqrt(2 * area)
    return max(0, math.floor(gross))


def die_yield(area: float, c: CostConstants) -> float:
    """Murphy's yield of a die of `area` mm^2 at the defect density (Murphy, Proc. IEEE 1964)."""
    ad = area / 100 * c.defect_density_per_cm2  # mm^2 -> cm^2
    if ad < 1e-12:  # the limit at no defects: every die good
        return 1.0
    return ((1 - math.exp(-ad)) / ad) ** 2


def die_usd(area: float, c: CostConstants) -> float:
    """One good die: the wafer's price over its good dies; +inf when no whole die fits the wafer."""
    good = dies_per_wafer(area, c) * die_yield(area, c)
    return c.wafer_usd / good if good > 0 else math.inf


# ---- networks ----------------------------------------------------------------------------------------


def fat_tree_tiers(endpoints: float, radix: int) -> int:
    """The fewest tiers of a folded-Clos tree of `radix`-port switches that reach `endpoints` ports:
    t tiers reach 2 (radix/2)^t (Al-Fares et al., SIGCOMM 2008)."""
    tiers = 1
    while 2 * (radix / 2) ** tiers < endpoints:
        tiers += 1
    return tiers


@dataclass(frozen=True)
class DeviceCost:
    """One device's share of the cluster's capital cost, US$, by part (`total` sums them)."""

    die: float
    package: float
    hbm: float
    host: float
    nics: float
    scale_out: float  # its NICs' share of the scale-out switches and links
    scale_up: float  # its links' share of the scale-up switch chips and cables

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _nic_parts(system: System, c: CostConstants) -> tuple[float, float]:
    """(the device's NICs, their share of the fat tree), US$."""
    nics_per_device = system.nics / system.devices_per_node
    nic_gbps = system.nominal_inter_node.bandwidth * system.devices_per_node / system.nics / GBPS
    ports_per_nic = nic_gbps / c.switch_port_gbps  # a NIC's bandwidth in switch ports
    tiers = fat_tree_tiers(nics_per_device * system.accelerators * ports_per_nic, c.switch_ports)
    fabric = ports_per_nic * ((2 * tiers - 1) * c.switch_usd / c.switch_ports + tiers * c.link_usd)
    return nics_per_device * nic_gbps * c.nic_usd_per_gbps, nics_per_device * fabric


def _scale_up(system: System, c: CostConstants) -> float:
    """The device's scale-up links' share of the domain's switch chips and cables, US$."""
    domain = system.devices_per_node
    if system.torus is not None or domain == 1:
        return 0.0
    links = system.nominal_intra_node.bandwidth / GBPS / c.scaleup_link_gbps
    tiers = fat_tree_tiers(domain, c.scaleup_switch_ports)
    chips = links * (2 * tiers - 1) / c.scaleup_switch_ports
    cables = links * tiers if domain > c.scaleup_board_devices else 0.0
    return chips * c.scaleup_switch_usd + cables * c.scaleup_cable_usd_per_link


def device_cost(accel: Accelerator, system: System, constants: CostConstants | None = None) -> DeviceCost:
    """One device's share of the cluster's capital cost (module docstring), by part."""
    c = constants or load_constants()
    nics, fabric = _nic_parts(system, c)
    return DeviceCost(die=die_usd(area_mm2(accel), c), package=c.package_usd,
                      hbm=accel.hbm_bytes / GIB * c.hbm_usd_per_gib, host=c.host_usd_per_device,
                      nics=nics, scale_out=fabric, scale_up=_scale_up(system, c))


def cluster_cost_usd(accel: Accelerator, system: System, constants: CostConstants | None = None) -> float:
    """The cost objective: every device of the cluster with its share of the network, US$."""
    return system.accelerators * device_cost(accel, system, constants).total
