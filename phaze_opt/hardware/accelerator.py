"""The accelerator template: one training chip, as an immutable value.

Only independent design choices are fields; everything that follows from them (peak FLOP/s and
the like) is a property, so two equal designs can never disagree about a derived figure.
Units are SI: bytes, bytes/s, Hz.

`efficiency` (hardware/efficiency.py) says how well a preset's software stack uses the template; its
identity default leaves every latency as the template computes it, and `compute_key` and `fields()`
then read exactly as they did before the field existed (cache keys and logged parameters unchanged).

`tc_datatypes` lists the number formats the tensor cores multiply and their MAC rate in each, in
MACs per PE per cycle (BF16 is the template's 1, the rate `peak_flops` counts). The BF16-only
default likewise leaves `compute_key` and `fields()` as they were.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

from .efficiency import IDENTITY, Efficiency, as_efficiency
from .memory import l2_bytes

BF16_ONLY = (("bf16", 1.0),)  # the template's tensor cores: BF16 at one MAC per PE per cycle


@dataclass(frozen=True)
class Accelerator:
    num_tc: int  # tensor cores
    tc_x: int  # PE array width (columns)
    tc_y: int  # PE array depth (rows)
    num_vc: int  # vector cores
    vc_width: int  # lanes per vector core
    glb_bytes: int  # on-chip global buffer
    glb_bw: float  # global buffer bandwidth, bytes/s
    hbm_bytes: int  # off-chip memory capacity
    hbm_bw: float  # off-chip memory bandwidth, bytes/s
    clock_hz: float
    name: str = ""
    efficiency: Efficiency = field(default=IDENTITY)
    # (format, MACs per PE per cycle) of each number format the tensor cores support, BF16 first
    tc_datatypes: tuple = BF16_ONLY
    # Whether the tensor cores read a per-tensor FP8 operand in either major order. Hopper's FP8 MMA
    # takes both operands K-major only, so a weight used column-wise (the data gradient) needs a
    # transposed FP8 copy; Blackwell's reads both orders ("Blackwell supports columnwise access
    # natively", Transformer Engine user guide, FP8 primer, "Handling transposes"). Memory only:
    # one FP8 weight copy instead of two (workload/precision.py `weight_copy_bytes`).
    tc_fp8_any_layout: bool = False

    def __post_init__(self):
        if not isinstance(self.efficiency, Efficiency):  # e.g. the mapping `fields()` wrote
            object.__setattr__(self, "efficiency", as_efficiency(self.efficiency))
        object.__setattr__(self, "tc_datatypes", as_datatypes(self.tc_datatypes))

    def mac_rate(self, datatype: str) -> float | None:
        """MACs per PE per cycle in `datatype`; None when the tensor cores do not support it."""
        return dict(self.tc_datatypes).get(datatype)

    @property
    def datatype_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tc_datatypes)

    @property
    def peak_flops(self) -> float:
        """Peak 16-bit tensor FLOP/s: one multiply-add (2 FLOP) per PE per cycle."""
        return 2.0 * self.num_tc * self.tc_x * self.tc_y * self.clock_hz

    @property
    def compute_key(self) -> tuple:
        """The fields that decide operator latencies and schedules (HBM capacity does not)."""
        key = (self.num_tc, self.tc_x, self.tc_y, self.num_vc, self.vc_width, self.glb_bytes,
               self.glb_bw, self.hbm_bw, self.clock_hz)
        key = key if self.efficiency.is_identity else key + (("efficiency",) + self.efficiency.key(),)
        return key if self.tc_datatypes == BF16_ONLY else key + (("tc_datatypes",) + self.tc_datatypes,)

    @property
    def tc_pes(self) -> int:
        """PEs in one tensor core."""
        return self.tc_x * self.tc_y

    @property
    def vc_peak_ops(self) -> float:
        """Vector lane operations per second over all vector cores (one op per lane per cycle)."""
        return float(self.num_vc * self.vc_width * self.clock_hz)

    @property
    def l2_tc_bytes(self) -> int:
        """Local buffer of one tensor core, by the published system's sizing rule (hardware.memory)."""
        return int(l2_bytes(self.tc_pes))

    @property
    def l2_vc_bytes(self) -> int:
        """Local buffer of one vector core (a vc_width x 1 array for sizing)."""
        return int(l2_bytes(self.vc_width))

    def fields(self) -> dict:
        """The fields as plain values; `efficiency` only when it is not the identity."""
        out = asdict(self)
        if self.efficiency.is_identity:
            del out["efficiency"]
        if self.tc_datatypes == BF16_ONLY:
            del out["tc_datatypes"]
        else:
            out["tc_datatypes"] = dict(self.tc_datatypes)
        if not self.tc_fp8_any_layout:  # the default stays out of the mapping (and every key built from it)
            del out["tc_fp8_any_layout"]
        return out


def as_datatypes(value) -> tuple:
    """(format, rate) pairs, BF16 first then by name, from pairs or a {format: rate} mapping; BF16
    at rate 1 must be among them (the template's unit). Files are checked by `hardware.arch`."""
    pairs = dict(value.items() if isinstance(value, Mapping) else value)
    if pairs.get("bf16") != 1.0:
        raise ValueError(f"tc_datatypes must include bf16 at 1 MAC per PE per cycle, got {pairs!r}")
    return (("bf16", 1.0),) + tuple(sorted((str(k), float(v)) for k, v in pairs.items() if k != "bf16"))
