"""Collectives on a torus of chips (a TPU v4 slice): which torus lines a parallel group occupies,
and the point-to-point link, ring all-reduce and all-to-all it gets there.

Why a torus needs its own model. On a two-level cluster a group is either inside a node (fast
links) or not; a TPU v4 pod has no such boundary: every chip has six inter-chip-interconnect (ICI)
links to its neighbours in a 3D torus of up to 16 x 16 x 16 chips (4 x 4 x 4 cubes joined by optical
circuit switches; Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer for Machine
Learning with Hardware Support for Embeddings", ISCA 2023, Sec. 2). What a collective gets depends
on how many torus dimensions its group spans and whether it closes a ring around them.

Rank layout. Ranks fill the torus in row-major order, dimension 0 fastest (rank = x0 + n0 (x1 +
n1 x2 ...)), so with the project's rank order (TP innermost, then CP, then EP/DP and PP; see
`phaze_opt.system`) a TP group of t consecutive ranks lies along dimension 0 first, and the peers of
a group at rank stride s are s ranks apart. A group of g ranks at stride s *maps onto the torus*
when, dimension by dimension, it takes q_i chips spaced r_i apart in dimension i: the stride is r_i
times the chips of the dimensions before (r_i dividing n_i), and the group either fills the line
(q_i r_i = n_i, then continues in the next dimension at stride n_0 ... n_i) or ends inside it with
q_i dividing n_i / r_i (so the groups of the other ranks tile the line).

A group that does not map but whose g x s ranks tile the slice (`lines`) still runs on ICI: its ring
is embedded along the rank order, the closing edge back along the same path. Consecutive ranks are
torus neighbours or, at the end of a line, one wraparound hop and one hop in the next dimension,
and the only group crossing a given line end is the one holding both ranks; so with s interleaved
groups every link direction carries at most s of them: an open line of g members at spacing s
(B / s a direction, one direction), a bound we take as the price. A group larger than the slice
(or straddling two) leaves the torus: the caller prices it at the inter-slice link.

Bandwidth of a group in one dimension (per chip, per direction of a link of bandwidth B):
- the r_i - 1 interleaved groups of the other ranks share each link of the line: B / r_i each;
- a line that closes around the torus (q_i r_i = n_i, wraparound on, q_i >= 3) carries a
  bidirectional ring: two rings, one per direction, each over half the data (the standard ring
  on a torus, Patarasuk and Yuan, JPDC 2009; TPU pods: Kumar et al., "Exploring the limits of
  concurrency in ML training on Google TPUs", MLSys 2021, Sec. 3, and Ying et al., "Image
  Classification at Supercomputer Scale", 2018, the 2D all-reduce): 2 B / r_i;
- an open line (a segment of q_i < n_i / r_i chips, or no wraparound) embeds one ring whose
  closing edge runs back along the line: every link carries one message per direction per step,
  B / r_i, the same as a ring of q_i at one link.

Ring all-reduce over k dimensions (`ring_link`). A multi-dimensional all-reduce runs a reduce-
scatter dimension by dimension and an all-gather back (each dimension's ring carries the data
already divided by the dimensions before it), and splits the message into k chunks that start in
different dimensions, so every dimension's links work at once (TPU v4 paper, Sec. 2.3: the 3D torus
"all-reduce bandwidth"; Kumar et al. 2021, Sec. 3.2 on the 2D torus all-reduce of TPU v3 pods).
We price it with a barrier after each phase: phase p takes the slowest chunk's step,
    T = sum_p max_c 2 (q - 1) / q x m_(c,p) / b,  chunk c in dimension (c + p) mod k at phase p,
    m_(c,p) = (n / k) / (the member counts of the dimensions chunk c already reduced over),
with q, b the dimension's members and bandwidth; latency 2 (q_i - 1) steps per dimension, summed.
The barrier makes it an upper bound on the pipelined schedule (conservative). It is returned as the
`Link` a single ring of g members would need to take the same time (the latency model prices
collectives as one ring: 2 (g - 1) / g x n / bw + 2 (g - 1) x latency), exact in the alpha-beta
model because both terms are affine in n. Checks: one dimension is the plain (bidirectional) ring;
a full 16 x 16 x 16 pod gives about 6 B = 300 GB/s a chip at 50 GB/s a link, and Google Cloud
publishes 1.1 PB/s of all-reduce bandwidth for the 4096-chip pod, 269 GB/s a chip, 90% of it
(cloud.google.com/tpu/docs/v4, "Key specifications").

Point to point (`neighbour_link`). A ring neighbour (a CP ring's K/V hand-off, a stage boundary)
is one link away along the group's first dimension: one link at B / r (conservative: one link, not
the six a chip has; the TPU v4 paper gives no multi-path p2p figure).

All-to-all (`alltoall_s`). Pairwise exchange on one link (as the two-level model prices it) is
not enough on a torus, whose bisection limits an all-to-all (Dally and Towles, "Principles and
Practices of Interconnection Networks", 2004, Sec. 3.3: a uniform all-to-all is bisection-bound on a
torus): half of each member's bytes cross the cut of its longest dimension, so e n / 4 bytes a
direction over the e / q links a line contributes (twice that with wraparound), each at b:
    max((e - 1)(alpha + n / e / b_0), max_i n q_i r_i / (4 w_i B)),  w_i = 2 closed, 1 open.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import config_error

# Largest number of torus dimensions a slice may have: TPU v2/v3 are 2D, v4/v5p 3D; four leaves room
# for a pod of pods written as a torus, and nothing more is built.
MAX_DIMS = 4


@dataclass(frozen=True)
class Line:
    """A group's share of one torus dimension: `members` chips `spacing` apart; `closed`: a ring
    around the torus (wraparound, the whole line), else an open segment."""

    dim: int
    members: int
    spacing: int
    closed: bool

    def directions(self) -> int:
        return 2 if self.closed else 1


@dataclass(frozen=True)
class Torus:
    """A slice's torus shape: chips per dimension, dimension 0 the fastest-varying rank, and whether
    each dimension closes around (wraparound links; an open mesh otherwise). The link itself is the
    system's (`System.intra_node`), so the efficiency block applies to it like any link."""

    dims: tuple[int, ...]
    wraparound: bool = True

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    def span(self, g: int, stride: int) -> tuple[Line, ...] | None:
        """The torus lines a group of g ranks at rank `stride` occupies (module docstring), () for a
        group of one, None when the group does not map onto the torus (misaligned or larger)."""
        if g < 1 or stride < 1:
            raise ValueError(f"span needs g >= 1 and stride >= 1, got {g}, {stride}")
        lines: list[Line] = []
        left, block = g, 1  # members still to place; ranks per step of the current dimension
        for i, n in enumerate(self.dims):
            if left == 1:
                break
            if stride % (block * n) == 0:  # the group does not move in this dimension
                block *= n
                continue
            if stride % block or n % (stride // block):
                return None
            spacing = stride // block
            room = n // spacing
            if left >= room:
                if left % room:
                    return None
                members = room
                stride = block * n  # the next member after a full line is one step on
            else:
                if room % left:
                    return None
                members = left
            closed = self.wraparound and members * spacing == n and members >= 3
            lines.append(Line(i, members, spacing, closed))
            left //= members
            block *= n
        return tuple(lines) if left == 1 else None

    def lines(self, g: int, stride: int) -> tuple[Line, ...] | None:
        """The group's torus lines (`span`), else, when its g x stride ranks tile the slice, its
        rank-order path as one open line of g members `stride` apart (module docstring); None when
        the group leaves the slice."""
        span = self.span(g, stride)
        if span is not None or self.size % (g * stride):
            return span
        return (Line(0, g, stride, False),)


def ring_seconds_per_byte(lines: tuple[Line, ...], bandwidths: tuple[float, ...]) -> float:
    """Seconds per byte of the bandwidth term of the k-dimensional all-reduce (module docstring):
    k chunks, chunk c reduced over dimensions c, c + 1, ... in turn, a barrier after each phase."""
    k = len(lines)
    total = 0.0
    for p in range(k):
        slowest = 0.0
        for c in range(k):
            done = math.prod(lines[(c + j) % k].members for j in range(p))
            line, bw = lines[(c + p) % k], bandwidths[(c + p) % k]
            slowest = max(slowest, 2.0 * (line.members - 1) / line.members / k / done / bw)
        total += slowest
    return total


def parse_torus(raw, file) -> tuple[Torus, dict]:
    """The `torus:` block: (the shape, its `link` mapping for the caller to parse). One-line errors."""
    allowed = ("dims", "link", "wraparound")
    if not isinstance(raw, dict):
        raise config_error(file, "torus", f"expected a mapping of {', '.join(allowed)}, got {raw!r}")
    for key in raw:
        if key not in allowed:
            raise config_error(file, f"torus.{key}", f"unknown field; allowed fields are {', '.join(allowed)}")
    for key in ("dims", "link"):
        if key not in raw:
            raise config_error(file, f"torus.{key}", "missing required field")
    dims = raw["dims"]
    if (not isinstance(dims, list) or not 1 <= len(dims) <= MAX_DIMS
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims)):
        raise config_error(file, "torus.dims",
                           f"must be a list of 1 to {MAX_DIMS} positive integers (chips per dimension), got {dims!r}")
    wrap = raw.get("wraparound", True)
    if not isinstance(wrap, bool):
        raise config_error(file, "torus.wraparound", f"must be true or false, got {wrap!r}")
    return Torus(tuple(dims), wrap), raw["link"]


def ring_equivalent(lines: tuple[Line, ...], link_bandwidth: float, link_latency: float) -> tuple[float, float]:
    """(bandwidth, latency) of the single ring of g = prod(members) ranks that takes as long as the
    k-dimensional all-reduce over `lines` (module docstring); a group of one: the link itself."""
    g = math.prod(line.members for line in lines)
    if g <= 1:
        return link_bandwidth, link_latency
    torus_bw = tuple(line.directions() * link_bandwidth / line.spacing for line in lines)
    per_byte = ring_seconds_per_byte(lines, torus_bw)
    steps = sum(line.members - 1 for line in lines)  # per direction; the ring's 2 (g - 1) halves too
    return 2.0 * (g - 1) / g / per_byte, link_latency * steps / (g - 1)


def alltoall_seconds(lines: tuple[Line, ...], nbytes: float, link_bandwidth: float, link_latency: float) -> float:
    """An all-to-all of `nbytes` per chip over the group on `lines`: pairwise exchange on one link of
    the first line, or the bisection of the longest line, whichever is slower (module docstring)."""
    e = math.prod(line.members for line in lines)
    if e <= 1:
        return 0.0
    pairwise = (e - 1) * (link_latency + nbytes / e / (link_bandwidth / lines[0].spacing))
    bisection = max(nbytes * line.members * line.spacing / (4.0 * line.directions() * link_bandwidth)
                    for line in lines)
    return max(pairwise, bisection)


def two_level_ring_equivalent(lines: tuple[Line, ...], outer: int, link: tuple[float, float],
                              outer_link: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth, latency) of the single ring of g x outer ranks that takes as long as a hierarchical
    all-reduce: reduce-scatter inside each slice over `lines` (g members), an all-reduce of the 1/g
    shard across the `outer` slices on `outer_link`, an all-gather back (Kumar et al. 2021, Sec. 3.2;
    PaLM, Chowdhery et al. 2022, Sec. 4: only the pod-level exchange crosses the data-center network).
    `link`, `outer_link`: (bandwidth, latency) of an ICI link and of the inter-slice link."""
    g = math.prod(line.members for line in lines)
    d = g * outer
    if d <= 1:
        return link
    inner_bw, inner_lat = ring_equivalent(lines, *link)
    per_byte = (2.0 * (g - 1) / g / inner_bw if g > 1 else 0.0) + \
        (2.0 * (outer - 1) / outer / g / outer_link[0] if outer > 1 else 0.0)
    latency = (2 * (g - 1) * inner_lat + 2 * (outer - 1) * outer_link[1]) / (2 * (d - 1))
    return 2.0 * (d - 1) / d / per_byte, latency
