"""How well a software stack uses the accelerator template: a few global, physical efficiencies.

The analytical template (hardware/latency.py) prices an operator by what the chip can do at best:
peak tensor-core rate, the datasheet HBM bandwidth, a GEMM dataflow that streams the activation once
per column tile, no cost to start a kernel. A real chip running a real stack (cuBLAS/CUTLASS kernels,
PyTorch launching one kernel per operator) differs in ways the template cannot derive from its
fields. `Efficiency` states those differences as a handful of numbers, each one a physical quantity
that a microbenchmark could measure on its own, global to a preset (never per model, per layer or
per operator):

- `gemm_tile_reuse` (>= 1, identity 1): column tiles of the stationary operand that share one
  streamed pass of the activation A through the global buffer. The template streams A from the GLB
  once per tc_x-wide column tile; a tiled GEMM kernel keeps a block of A in the core's local buffer
  (shared memory / registers) and multiplies it against several column tiles before fetching the next
  block, as CUTLASS's hierarchical tiling does (a threadblock tile of 128 x 256 output elements over a
  64-column array is 4 column tiles per pass of A; Hopper's 2-SM clusters multicast A to both SMs,
  halving it again). GLB traffic of A becomes A x ceil(col_tiles / reuse).
  Source: NVIDIA CUTLASS documentation, "Efficient GEMM in CUDA" (threadblock, warp and
  instruction-level tiles); Kerr et al., "CUTLASS: Fast Linear Algebra in CUDA C++" (NVIDIA blog, 2017).
- `gemm_wave_balance` [0, 1], identity 0: how much of the last wave's idle cores a GEMM kernel fills.
  The template deals whole column tiles to the cores in rounds (ceil(tiles / cores)), so 133 tiles on
  132 cores take two rounds; a Stream-K kernel splits the remaining work along K across all cores, so
  its time follows the work (tiles / cores) instead (Osama et al., "Stream-K: Work-centric Parallel
  Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023; CUTLASS 3 and cuBLAS
  ship such schedules for Hopper). Rounds become ceil(r) - balance x (ceil(r) - r), r = tiles / cores.
- `tc_fraction` (0, 1], identity 1: the fraction of the tensor-core peak a large compute-bound GEMM
  kernel sustains (instruction issue, synchronisation between pipeline stages, clock droop under
  load). Dense BF16 cuBLAS GEMMs reach about 75-80% of H100 SXM's 989 TFLOP/s (the 8192^3 GEMM of
  configs/validation/truth: 693 TFLOP/s; the blocks' 2048-token projections 720-769).
- `low_precision_fraction` (0, 1], identity 1: the share of a low-precision format's nominal MAC rate
  (`tc_datatypes`, e.g. FP8 at 2x BF16 on Hopper) that the stack's GEMM kernels keep relative to its
  BF16 kernels: scaled FP8 GEMMs stage scales and convert their outputs, and the wider K per
  instruction leaves more of a tile's pipeline exposed. Measured for H100 by this project
  (presets/validation/truth/h100-fp8-gemms-2026.json: cuBLASLt FP8 E4M3 via `torch._scaled_mm` against
  BF16 `torch.mm` on the twelve linear-layer shapes of Llama-3 8B/70B/405B blocks): FP8 ran 1.46-1.96x
  the BF16 rate, median 1.83 of the nominal 2, so 0.92. Derived from GEMM timings, not fitted to
  training runs. Multiplies the rate of every format but BF16.
- `hbm_fraction` (0, 1], identity 1: achieved fraction of the datasheet HBM bandwidth by the stack's
  memory-bound kernels. Its ceiling is a STREAM-like copy: 750 of V100's 900 GB/s, 83% (Jia et al.,
  "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, ch. 3); studies of Hopper
  (Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU Architecture", IPDPS 2024) likewise
  stay below the datasheet. Kernels that do more per byte than a copy (softmax's row reductions,
  dropout's random numbers and mask, masked_fill with a broadcast mask) reach less: fitted on eager
  PyTorch's H100 layers, 0.59 (configs/archs/h100-sxm.yaml). Applies to every HBM-bound term (GEMM
  re-reads, vector ops, fused attention).
- `op_overhead_s` (>= 0 s, identity 0): a fixed cost per operator (kernel launch gap and the ramp and
  tail of a kernel's waves) added to every operator that runs on the cores, once per kernel it
  launches (a grouped GEMM its stack issues expert by expert: once per expert; latency.kernels_of).
  Eager PyTorch launches one kernel per operator: a CUDA launch costs a few microseconds (~2-5 us)
  and PyTorch's dispatch with autograd recording some more on the host, which shows when kernels
  are short; fitted on the H100 layers, 17 us. Collectives keep their own latency term (the link's),
  "none" ops stay free.
  The schedule may overlap it like any op time (ops on different cores); eager PyTorch runs one
  kernel at a time, and on the H100 blocks the exact schedules are within 0.6% of serial.

The identity (`Efficiency()`) leaves every latency exactly as the template computes it, so presets
without an `efficiency:` mapping, the default search space and every published number are unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..configs import Limit
from ..errors import PhazeError, config_error, shown

# What each field may be: (lowest allowed, whether the lowest is allowed, Limit above, unit in errors).
# The upper limits are far beyond any real stack so that only a typo reaches them.
_RANGES = {
    # 4096 column tiles per pass: a whole 4096-wide array side of 64-column tiles, 64x more than any
    # GEMM kernel's tile (CUTLASS's largest threadblock tiles are 256 columns wide).
    "gemm_tile_reuse": (1.0, True, Limit(4096, "64x the column tiles of the widest GEMM kernel tile")),
    "gemm_wave_balance": (0.0, True, Limit(1.0, "a fraction of the last wave")),
    "tc_fraction": (0.0, False, Limit(1.0, "a fraction of the peak")),
    "hbm_fraction": (0.0, False, Limit(1.0, "a fraction of the datasheet bandwidth")),
    "low_precision_fraction": (0.0, False, Limit(1.0, "a fraction of the format's nominal rate")),
    # 1 ms per operator is 200x a kernel launch (~5 us).
    "op_overhead_s": (0.0, True, Limit(1e-3, "200x the ~5 us of a kernel launch")),
}


@dataclass(frozen=True)
class Efficiency:
    """Global efficiencies of a preset's software stack; see the module docstring for each."""

    gemm_tile_reuse: float = 1.0
    gemm_wave_balance: float = 0.0
    tc_fraction: float = 1.0
    hbm_fraction: float = 1.0
    op_overhead_s: float = 0.0
    low_precision_fraction: float = 1.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            problem = _problem(name, value)
            if problem:
                raise PhazeError(f"efficiency {name} {problem}")

    @property
    def is_identity(self) -> bool:
        return self == IDENTITY

    def key(self) -> tuple:
        """The values in field order (for content keys)."""
        return tuple(float(getattr(self, f.name)) for f in fields(self))

    def fields(self) -> dict:
        return asdict(self)


def _problem(name: str, value) -> str | None:
    low, inclusive, limit = _RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return f"must be a number, got {shown(value)}"
    if not (value >= low if inclusive else value > low):
        return f"must be {'at least' if inclusive else 'greater than'} {low:g}, got {shown(value)}"
    if not value <= limit.maximum:
        return f"must be at most {limit.maximum:g} ({limit.why}), got {shown(value)}"
    return None


IDENTITY = Efficiency()
FIELDS = tuple(f.name for f in fields(Efficiency))


def efficiency_from_mapping(data, file, label: str = "efficiency") -> Efficiency:
    """An arch file's `efficiency:` mapping; an unknown key or a value out of range is a one-line
    PhazeError naming the file and the field (`efficiency.tc_fraction`)."""
    if data is None:
        return IDENTITY
    if not isinstance(data, dict):
        raise config_error(file, label, f"must be a mapping of {', '.join(FIELDS)}, got {shown(data)}")
    for key in data:
        if key not in FIELDS:
            raise config_error(file, f"{label}.{key}", f"unknown field; allowed fields are {', '.join(FIELDS)}")
    values = {}
    for key, value in data.items():
        problem = _problem(key, value)
        if problem:
            raise config_error(file, f"{label}.{key}", problem)
        values[key] = float(value)
    return Efficiency(**values)


def as_efficiency(value) -> Efficiency:
    """An Efficiency from itself, None (identity) or a mapping of its fields (e.g. `Accelerator.fields()`)."""
    if value is None:
        return IDENTITY
    if isinstance(value, Efficiency):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(FIELDS)
        if unknown:
            raise PhazeError(f"efficiency: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(FIELDS)}")
        return Efficiency(**{k: float(v) for k, v in value.items()})
    raise PhazeError(f"efficiency must be an Efficiency or a mapping of {', '.join(FIELDS)}, got {shown(value)}")
