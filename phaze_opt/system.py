"""The cluster a model trains on: accelerator count, nodes, links, batch, precision, optimizer.

A `System` is loaded from `configs/systems/<name>.yaml` and validated on load. Link bandwidths and
latencies may be written with units (`300 GB/s`, `4 GiB/s`, `200 Gbit/s`, `1 us`, `500 ns`) or as
plain SI numbers (bytes/s, seconds); inside the code they are always bytes/s and seconds.

Where devices sit decides which link a collective or a pipeline transfer uses. We fix one layout,
Megatron-like with tensor parallelism innermost (Narayanan et al., SC'21, sec. 3.3: keep the
all-reduce-heavy TP group on the fast in-node links):

    rank = tp_rank + t * (stage + pp * replica)

so a TP group is t consecutive ranks, a pipeline replica is pp*t consecutive ranks, and the data-
parallel peers of a stage are pp*t ranks apart. From that layout (nodes are `devices_per_node`
consecutive ranks):

- a TP group of width t uses the intra-node link when t divides devices_per_node; a group of whole
  nodes spans them with every NIC (`spanning_link`, below); any other width the inter-node link
  (`tp_link`);
- the pipeline hops of a replica use the intra-node link only when pp*t divides devices_per_node
  (every replica then sits inside one node); otherwise every hop is charged at the inter-node link,
  even a hop that happens to stay inside a node. That is conservative, and it keeps a stage's time
  independent of where in the pipeline it sits, which the placement DP relies on (`pipeline_link`);
- the data-parallel ring of a stage is intra-node only when the whole job (pp*t*dp devices) fits in
  one node (`dp_link`, conservative where pp > 1); a ring that crosses nodes spreads its inter-node
  part over the NICs of its members in each node, as a TP group of whole nodes does
  (`dp_ring_link`, `spanning_link` below): its dp ranks sit t apart (the rank order puts TP, then
  CP, inside DP: Megatron-Core's tp-cp-dp-pp, torchtitan's mesh [pp, dp, cp, tp]), so every node it
  touches holds a multiple of gcd(dp, devices_per_node / t) of them (`ring_members_per_node`). FSDP
  over whole nodes (t = 1) thus gathers at the node's eight NICs, not one; TP 8 keeps one member a
  node and the one-NIC link.

Every device has its own intra-node link of the stated bandwidth per direction, so concurrent rings
and transfers of different devices do not share it. Between nodes, a node has `nics_per_node` NICs of
`inter_node.bandwidth` each (default one per device, as in a DGX node: the meaning every older file
had); `System.inter_node` is one device's share of them (nics x NIC bandwidth / devices per node), what
each device gets when every device of the node sends at once (pipeline hops, all-to-alls, a CP ring).
A collective group that spans nodes with r members in each node shares its ring's inter-node part over
the NICs of those r members: NCCL runs one channel per NIC and splits the data over the channels, so a
ring all-reduce of whole DGX A100 nodes reaches 192 GB/s bus bandwidth over 8 x 200 Gbit/s HDR (NCCL
maintainer, NVIDIA/nccl issue #812), about 8 NICs' worth, and more NICs give more bandwidth up to the
NVLink bandwidth (NVIDIA/nccl issue #412). Such a group's link (`spanning_link`) has r x the per-device
share, capped at the intra-node link (the ring's NVLink hops carry the same bytes), and the inter-node
latency.

Efficiency (fitted by `validate --fit`). A system file may carry an `efficiency:` block of global physical parameters
that the analytical model cannot know because they belong to the software stack (see
`SystemEfficiency`): the fraction of each link's bandwidth that collectives and transfers achieve, and
a fixed per-iteration overhead. Loading applies the fractions to the links (`System.intra_node` and
`inter_node` are the achieved links; `nominal_intra_node` / `nominal_inter_node` the datasheet ones),
so every cost model that uses a link uses the achieved one. Without the block every value is the
identity (fractions 1, overhead 0) and a system means exactly what it meant before.

Torus (a TPU v4 slice). A system file may describe its fast network as a torus instead of nodes
(`torus: {dims: [8, 8, 16], link: {bandwidth, latency}, wraparound: true}`; `phaze_opt.torus`
holds the model and its sources). The slice is then the "node": `devices_per_node` is the torus's
chip count and `intra_node` its link (one ICI link per direction); `inter_node` is the network
between slices (the data-center network). What changes with a torus, and what does not:

- TP all-reduces (`tp_link`) run as multi-dimensional rings over the torus lines the group spans
  (bidirectional where a line closes around the torus), returned as the equivalent single-ring link;
- a CP ring's neighbour hand-off (`cp_link`) uses one link (shared by interleaved groups);
- an all-to-all (`alltoall_s`) is bisection-bound on the torus;
- a group inside the slice that does not map onto torus lines runs as a ring along the rank order
  (one direction of one link, shared by interleaved groups); one that leaves the slice is priced as
  before, at the inter-node link;
- pipeline hops keep the two-level rule above, with the slice as the node: the placement DP
  vectorises exactly that rule (solve/placement/dp.py, `_pairs` and `_general_groups`), and the
  evaluator must agree with it. With a torus that prices a stage hop at one ICI link when S t
  divides the slice (exact for stage neighbours one torus hop apart, optimistic by the hop count
  when S t is not a product of leading dimensions), at the inter-slice link when it does not
  (pessimistic: the hop stays on ICI);
- a data-parallel ring is priced as the ring a torus does give (`dp_ring_link`: hierarchical, multi-dimensional inside a
  slice, the 1/g shards across slices), by the evaluator and by both placement DPs
  (`solve.placement.kernel.RingLinks`). On PaLM 540B
  (tpuv4-2x3072, ZeRO-3 over 512 replicas) it is the difference between 17.7 s and 45.8 s an
  iteration (published: 17.6 s), the two-level rule pricing the whole ring at the inter-slice link.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from . import configs
from .configs import Limit, check_keys, one_of, positive_int
from .errors import config_error, shown
from .torus import Torus, alltoall_seconds, parse_torus, ring_equivalent, two_level_ring_equivalent

if TYPE_CHECKING:
    from .training import Training

PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per element of weights and gradients
OPTIMIZERS = ("adam", "sgd")
OPTIMIZER_MEMORY = ("mixed_precision", "phaze")

_BANDWIDTH_UNITS = {
    "B/s": 1.0, "kB/s": 1e3, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30, "TiB/s": 2.0**40,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8,
}
# Upper limits, checked on load before anything is sized by them (the placement search walks the
# data-parallel degrees up to `accelerators`). Each is far beyond any system built, so only a typo
# or a hostile file reaches one.
MAX_ACCELERATORS = 2**20
LIMITS = {
    # The largest training clusters have about 10^5 accelerators; 2^20 = 1,048,576 is 10x that.
    "accelerators": Limit(MAX_ACCELERATORS, "far beyond any cluster built, ~10^5 accelerators"),
    # A node (one fast-link domain) cannot hold more than the largest cluster; the largest built (2025)
    # are 72-576 GPUs (NVLink) or a 8,960-chip TPU v5p pod.
    "devices_per_node": Limit(MAX_ACCELERATORS, "no node is larger than the largest cluster"),
    # Sequences per optimizer step: the largest published batches are ~64k sequences (BERT with
    # LAMB) and a few thousand for LLMs; 2^24 = 16,777,216 is 256x that.
    "global_batch": Limit(2**24, "far beyond any published batch, ~64k sequences"),
}
MBS_LIMIT = LIMITS["global_batch"]  # a microbatch is part of one global batch (--mbs, spaces' mbs)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9].*?)?\s*$")



def routed_node_share(nodes: int, k: int, groups: int = 0, group_topk: int = 0) -> float:
    """The chance that a token's k routed experts include one on a given node of an EP group spread
    evenly over `nodes` nodes (experts laid out contiguously by rank, so each node holds an equal
    contiguous block), under balanced routing: 1 - (1 - 1/N)^k. With group-limited routing (the
    experts in G equal contiguous groups, a token's k experts drawn from its best M groups;
    DeepSeek-V3 report, Sec. 2.1.2), when a node holds G/N whole groups: the number j of the
    token's M groups on the node is hypergeometric, and the node is hit with 1 - (1 - j/M)^k; when
    a group spans N/G nodes: (M/G)(1 - (1 - G/(N M))^k). Other layouts, or M = G, fall back to the
    ungrouped share (M = G gives it exactly)."""
    if nodes <= 1:
        return 1.0
    free = 1.0 - (1.0 - 1.0 / nodes) ** k  # routed over every expert
    if not groups or group_topk >= groups:
        return free
    if groups % nodes == 0:
        per = groups // nodes
        total = math.comb(groups, group_topk)
        return sum(math.comb(per, j) * math.comb(groups - per, group_topk - j) / total * (1.0 - (1.0 - j / group_topk) ** k)
                   for j in range(0, min(per, group_topk) + 1))
    if nodes % groups == 0:
        return group_topk / groups * (1.0 - (1.0 - groups / (nodes * group_topk)) ** k)
    return free

@dataclass(frozen=True)
class Link:
    """A point-to-point link per device and direction, in the alpha-beta model (Hockney, 1994)."""

    bandwidth: float  # bytes/s
    latency: float  # s per message

    def transfer_s(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class SystemEfficiency:
    """Global, physical efficiency parameters of a cluster's software stack (fitted by `validate --fit`).

    intra_node_bandwidth: the fraction of the intra-node link's datasheet bandwidth that collectives
        and point-to-point transfers achieve. NCCL's all-reduce on 8 A100 over NVLink 3 / NVSwitch
        reaches a bus bandwidth of about 230 GB/s of the 300 GB/s per direction (nccl-tests,
        `all_reduce_perf`, large messages; NVIDIA DGX A100 user guide and NCCL performance notes).
    inter_node_bandwidth: the same for the inter-node link: NCCL's ring over 200 Gbit/s HDR
        InfiniBand reaches about 23 of 25 GB/s per GPU on large messages (nccl-tests over IB).
    microbatch_overhead_s: seconds each pipeline stage spends per microbatch and model chunk
        beyond its layers' kernels: the schedule's Python step (Megatron's `forward_step` /
        `backward_step` with their autograd and hook bookkeeping), the point-to-point send/receive
        set-up between stages and the host-device synchronisations around them. What the
        per-operator cost (`hardware.efficiency.Efficiency.op_overhead_s`) does not hold: it is
        paid once per schedule step, (m v + S - 1) times a batch
        (`solve.placement.evaluate`), so it weighs most where microbatches are many and small.

    There is no flat per-iteration constant: what a step does once (the optimizer step, its
    gradient-norm pass, zeroing the gradients) is priced from the bytes it moves
    (`solve.placement.types.optimizer_pass_bytes`), so it scales with the parameters per device
    and a short step is not charged a long step's cost.

    Identity: (1, 1, 0): every link at its nominal rate and no fixed cost (the uncalibrated template).
    """

    intra_node_bandwidth: float = 1.0
    inter_node_bandwidth: float = 1.0
    microbatch_overhead_s: float = 0.0

    @property
    def is_identity(self) -> bool:
        return self == IDENTITY_EFFICIENCY

    def to_dict(self) -> dict:
        return {"intra_node_bandwidth": self.intra_node_bandwidth,
                "inter_node_bandwidth": self.inter_node_bandwidth,
                # only when set: an uncalibrated system's reports and tracked params name no fixed cost
                **({"microbatch_overhead_s": self.microbatch_overhead_s} if self.microbatch_overhead_s else {})}


IDENTITY_EFFICIENCY = SystemEfficiency()
EFFICIENCY_FIELDS = ("intra_node_bandwidth", "inter_node_bandwidth", "microbatch_overhead")


@dataclass(frozen=True)
class System:
    name: str
    accelerators: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    global_batch: int  # sequences per optimizer step
    precision: str  # bf16 | fp16 | fp32
    optimizer: str  # adam | sgd
    optimizer_memory: str  # mixed_precision | phaze
    path: str = ""
    # The links above are the achieved ones: the datasheet link x the efficiency's fraction.
    efficiency: SystemEfficiency = IDENTITY_EFFICIENCY
    # NICs per node; `inter_node` is one device's share of them (the module docstring). 0: one per device.
    nics_per_node: int = 0

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.devices_per_node

    @property
    def nic_bandwidth(self) -> float:
        """One NIC's achieved bandwidth per direction, bytes/s."""
        return self.inter_node.bandwidth * self.devices_per_node / self.nics

    def spanning_link(self, members_per_node: int) -> Link:
        """The link of a collective group that spans nodes with `members_per_node` of its ranks in
        each (the module docstring): their share of the node's NICs, at most the intra-node link."""
        bandwidth = min(self.intra_node.bandwidth, members_per_node * self.inter_node.bandwidth)
        return Link(bandwidth, self.inter_node.latency)
    # The slice's torus (module docstring), its link `intra_node`; None: nodes of devices_per_node.
    torus: Torus | None = None

    @property
    def nominal_intra_node(self) -> Link:
        return Link(self.intra_node.bandwidth / self.efficiency.intra_node_bandwidth, self.intra_node.latency)

    @property
    def nominal_inter_node(self) -> Link:
        return Link(self.inter_node.bandwidth / self.efficiency.inter_node_bandwidth, self.inter_node.latency)

    def with_efficiency(self, efficiency: SystemEfficiency) -> "System":
        """This cluster with other efficiency parameters (the links rescaled from the nominal ones)."""
        intra, inter = self.nominal_intra_node, self.nominal_inter_node
        return replace(
            self, efficiency=efficiency,
            intra_node=Link(intra.bandwidth * efficiency.intra_node_bandwidth, intra.latency),
            inter_node=Link(inter.bandwidth * efficiency.inter_node_bandwidth, inter.latency))

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one weight or gradient element; gradients are all-reduced at this width."""
        return PRECISIONS[self.precision]

    @property
    def state_bytes_per_param(self) -> int:
        """Weights + gradients + optimizer state held per parameter on its device.

        mixed_precision (ZeRO, Rajbhandari et al., SC'20, sec. 3.1): with 16-bit training each
        parameter keeps a 16-bit weight and gradient plus an fp32 master weight (2 + 2 + 4 bytes);
        Adam adds fp32 momentum and variance (+8): 16 bytes. In fp32 there is no master copy:
        4 + 4, + 8 for Adam: again 16. Plain SGD (no momentum) keeps no state: 8 bytes either way.

        phaze (the published system's accounting): weights and gradients at the element width,
        plus one more copy for Adam: 3 elements (6 bytes in bf16), 2 for SGD.
        """
        e = self.bytes_per_element
        if self.optimizer_memory == "phaze":
            return e * (3 if self.optimizer == "adam" else 2)
        master = 4 if e < 4 else 0
        state = 8 if self.optimizer == "adam" else 0
        return 2 * e + master + state

    @property
    def grad_bytes_per_param(self) -> int:
        return self.bytes_per_element

    def tp_link(self, t: int) -> Link:
        """The link a TP group of width t all-reduces over (pass it to the latency model); on a
        torus the single-ring equivalent of its multi-dimensional ring (`_torus_ring`)."""
        if self.torus is not None:
            return self._torus_ring(t, 1)
        if self.devices_per_node % t == 0:
            return self.intra_node
        return self.spanning_link(self.devices_per_node) if t % self.devices_per_node == 0 else self.inter_node

    def tp_within_node(self, t: int) -> bool:
        """Whether a TP group of width t keeps its collectives on the node's (or torus's) links; the
        energy model prices those bytes at the intra-node energy per bit."""
        if self.torus is not None:
            return self.torus.lines(t, 1) is not None
        return self.devices_per_node % t == 0

    def pipeline_link(self, t: int, pp: int) -> Link:
        """The link between neighbouring pipeline stages (see the module docstring)."""
        return self.intra_node if self.devices_per_node % (pp * t) == 0 else self.inter_node

    def dp_link(self, t: int, pp: int, dp: int) -> Link:
        """The link of the data-parallel gradient ring (see the module docstring)."""
        return self.intra_node if pp * t * dp <= self.devices_per_node else self.inter_node

    def cp_link(self, t: int, c: int) -> Link:
        """The link of a context-parallel ring of c ranks at stride t (Megatron-Core's rank order
        tp, cp, ep/dp, pp: a CP group spans t*c consecutive ranks): intra-node when t*c divides a node."""
        if self.torus is not None:
            return self._torus_neighbour(c, t)
        return self.intra_node if self.devices_per_node % (t * c) == 0 else self.inter_node

    # --- torus pricing (module docstring "Torus"; phaze_opt.torus) ---------------------------------

    def _torus_ring(self, g: int, stride: int) -> Link:
        """The single-ring equivalent of a group's all-reduce on the torus; the intra-node link for
        a group of one, the inter-node link for a group that leaves the slice."""
        lines = self.torus.lines(g, stride)
        if lines is None:
            return self.inter_node
        if not lines:
            return self.intra_node
        bandwidth, latency = ring_equivalent(lines, self.intra_node.bandwidth, self.intra_node.latency)
        return Link(bandwidth, latency)

    def _torus_neighbour(self, g: int, stride: int) -> Link:
        """The link from a group member to its ring neighbour: one ICI link, shared by the groups
        interleaved with it on the line; the inter-node link when the group leaves the slice."""
        lines = self.torus.lines(g, stride)
        if lines is None:
            return self.inter_node
        if not lines or lines[0].spacing == 1:
            return self.intra_node
        return Link(self.intra_node.bandwidth / lines[0].spacing, self.intra_node.latency)

    def ring_members_per_node(self, t, dp, shard=None):
        """The fewest members a data-parallel ring of dp ranks t apart has in any node it touches
        (module docstring; ints or integer arrays): the group is a run of t x dp consecutive ranks
        and nodes are runs of devices_per_node, so their overlaps are multiples of
        t x gcd(dp, devices_per_node / t) ranks; 1 when t does not divide a node. Under HSDP
        (`shard`: its group of g ranks) the same ring also all-reduces across the dp / g replicas,
        g t apart, so it counts the fewer members of the two groups."""
        dpn = self.devices_per_node
        members = np.where(dpn % t == 0, np.gcd(dp, dpn // np.maximum(t, 1)), 1)
        if shard is not None:
            stride = t * shard
            members = np.minimum(members, np.where(dpn % stride == 0, np.gcd(dp // shard, dpn // stride), 1))
        return members

    def dp_ring_link(self, t: int, pp: int, dp: int, shard: int | None = None, spread: bool = True) -> Link:
        """The data-parallel ring the network actually gives, as the evaluator and the placement DPs
        price it (see the module docstring). Without a torus: inside a node by `dp_link`, else the
        `spanning_link` of its members per node (`ring_members_per_node`, HSDP's `shard` group
        counted); one member with `spread` off, for rings that also carry groups of other strides
        (a MoE's expert replicas). On a torus the single-ring equivalent
        of the hierarchical all-reduce, a multi-dimensional ring over the replicas inside a slice and
        a ring of the 1/g shards across slices; for a group that does not split into whole slices,
        `dp_link`."""
        if self.torus is None:
            link = self.dp_link(t, pp, dp)
            if link is self.intra_node:
                return link
            return self.spanning_link(int(self.ring_members_per_node(t, dp, shard)) if spread else 1)
        if dp <= 1:
            return self.dp_link(t, pp, dp)
        stride, size = pp * t, self.torus.size
        inner = dp if stride * dp <= size else size // stride
        if inner < 1 or dp % inner or (inner < dp and size % stride):
            return self.dp_link(t, pp, dp)
        lines = self.torus.lines(inner, stride)
        if lines is None:
            return self.dp_link(t, pp, dp)
        bandwidth, latency = two_level_ring_equivalent(
            lines, dp // inner, (self.intra_node.bandwidth, self.intra_node.latency),
            (self.inter_node.bandwidth, self.inter_node.latency))
        return Link(bandwidth, latency)

    # -----------------------------------------------------------------------------------------------

    def alltoall_members_per_node(self, e: int, stride: int) -> int:
        """How many of an all-to-all group's e ranks (at rank `stride` apart; the EP group sits after
        TP and CP, so stride = t*c) share each member's node: e when the group's e*stride ranks fit a
        node evenly, dpn/stride when the group spans whole nodes, else 1 (conservative: every peer
        counted as remote, as `pipeline_link` does for unaligned layouts)."""
        dpn = self.devices_per_node
        if dpn % (e * stride) == 0:
            return e
        if dpn % stride == 0 and (e * stride) % dpn == 0:
            return dpn // stride
        return 1

    def alltoall_s(self, nbytes: float, e: int, stride: int, training: "Training | None" = None,
                   copies: int = 1, groups: tuple[int, int] = (0, 0)) -> float:
        """An all-to-all of `nbytes` per device over e ranks (MoE dispatch or combine), by the
        recipe's dispatcher (`training.moe_dispatcher`; None: the plain all-to-all); `nbytes` holds
        `copies` copies of each token (the router's top-k), what DeepEP sends once per node.

        All-to-all, pairwise exchange (Thakur, Rabenseifner and Gropp, "Optimization of Collective
        Communication Operations in MPICH", IJHPCA 2005, Sec. 4.6: p - 1 steps of n/p bytes each):
        each device sends nbytes / e to each of its e - 1 peers, (e - 1)/e of its bytes crossing. On
        the two-level network the g - 1 peers in its node are reached on the intra-node link and the
        e - g others on the inter-node link; every device has its own port on each (the module
        docstring), so the two parts run at once and the slower sets the time:
        max((g - 1)(a_intra + n/e / B_intra), (e - g)(a_inter + n/e / B_inter)).

        DeepEP (DeepSeek-V3 tech report, arXiv 2412.19437, Sec. 3.2.2: tokens "first transmitted
        via IB to the GPUs with the same in-node index on their target nodes" and "forwarded via
        NVLink" to the GPUs hosting their experts; DeepEP's normal kernels, github.com/deepseek-ai/
        DeepEP README): a token crosses to each of the group's N = e/g nodes that holds one of its
        k experts once, whatever number of them sit there. Under uniform (balanced) routing a
        given other node holds one of them with probability 1 - (1 - 1/N)^k, so a device sends
        n/k x (N - 1)(1 - (1 - 1/N)^k) bytes over the inter-node link in N - 1 messages, against
        n (N - 1)/N for the all-to-all (k = 8, N = 4: 0.45 x). On NVLink it sends its copies for
        the g - 1 other ranks of its node, the local tokens' and those that arrived from other
        nodes (forwarded), n (g - 1)/g in all, beside the inter-node part (DeepEP pipelines the
        two). Inside one node (N = 1) nothing crosses: the all-to-all's time. On a torus, the
        all-to-all's. With group-limited routing (`groups` = (G groups, M per token), the model's
        `router_groups`, `router_group_topk`) fewer nodes are hit: `routed_node_share`.
        """
        if e <= 1:
            return 0.0
        lines = self.torus.lines(e, stride) if self.torus is not None else None
        if lines is not None:
            return alltoall_seconds(lines, nbytes, self.intra_node.bandwidth, self.intra_node.latency)
        g = self.alltoall_members_per_node(e, stride)
        if training is not None and training.moe_dispatcher == "deepep" and g < e:
            nodes = e // g
            k = max(1, int(copies))
            hit = routed_node_share(nodes, k, *groups)  # one given other node holds one of the k experts
            near = (g - 1) * self.intra_node.latency + nbytes * (g - 1) / g / self.intra_node.bandwidth
            far = (nodes - 1) * (self.inter_node.latency + nbytes / k * hit / self.inter_node.bandwidth)
            return max(near, far)
        part = nbytes / e
        near = (g - 1) * (self.intra_node.latency + part / self.intra_node.bandwidth)
        far = (e - g) * (self.inter_node.latency + part / self.inter_node.bandwidth)
        return max(near, far)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "accelerators": self.accelerators,
            "devices_per_node": self.devices_per_node,
            "intra_node": {"bandwidth_bytes_per_s": self.intra_node.bandwidth, "latency_s": self.intra_node.latency},
            "inter_node": {"bandwidth_bytes_per_s": self.inter_node.bandwidth, "latency_s": self.inter_node.latency},
            **({} if self.nics == self.devices_per_node else
               {"nics_per_node": self.nics, "nic_bandwidth_bytes_per_s": self.nic_bandwidth}),
            "global_batch": self.global_batch,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "optimizer_memory": self.optimizer_memory,
            "state_bytes_per_param": self.state_bytes_per_param,
            **({} if self.efficiency.is_identity else {"efficiency": self.efficiency.to_dict()}),
            **({} if self.torus is None else {"torus": {"dims": list(self.torus.dims),
                                                        "wraparound": self.torus.wraparound}}),
        }


# The most state bytes per parameter any system config can ask for (16: mixed precision with Adam).
MAX_STATE_BYTES_PER_PARAM = max(
    System("", 1, 1, Link(1.0, 0.0), Link(1.0, 0.0), 1, p, o, m).state_bytes_per_param
    for p in PRECISIONS for o in OPTIMIZERS for m in OPTIMIZER_MEMORY
)


def parse_quantity(value: Any, units: Mapping[str, float], file, field: str, allow_zero: bool) -> float:
    """A number in SI units, or a string `<number> <unit>`; returns SI. Bad input: one-line error."""
    allowed = ", ".join(units)
    if isinstance(value, bool):
        number = None
    elif isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        if not match:
            raise config_error(file, field, f"expected a number with a unit ({allowed}), got {shown(value)}")
        unit = match.group(2) or ""
        if unit and unit not in units:
            raise config_error(file, field, f"unknown unit {shown(unit)}; allowed units are {allowed}")
        number = float(match.group(1)) * (units[unit] if unit else 1.0)
    else:
        number = None
    if number is None or not math.isfinite(number):
        raise config_error(file, field, f"expected a number with a unit ({allowed}), got {shown(value)}")
    if number < 0 or (number == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise config_error(file, field, f"must be {need}, got {shown(value)}")
    return number


def _link(data: Mapping[str, Any], key: str, file, raw: Any = None) -> Link:
    raw = data[key] if raw is None else raw
    if not isinstance(raw, dict):
        raise config_error(file, key, f"expected a mapping with bandwidth and latency, got {shown(raw)}")
    for sub in raw:
        if sub not in ("bandwidth", "latency"):
            raise config_error(file, f"{key}.{sub}", "unknown field; allowed fields are bandwidth, latency")
    for sub in ("bandwidth", "latency"):
        if sub not in raw:
            raise config_error(file, f"{key}.{sub}", "missing required field")
    bandwidth = parse_quantity(raw["bandwidth"], _BANDWIDTH_UNITS, file, f"{key}.bandwidth", allow_zero=False)
    # A zero latency is allowed: it means "ignore per-message latency", as the published model did.
    latency = parse_quantity(raw["latency"], _TIME_UNITS, file, f"{key}.latency", allow_zero=True)
    return Link(bandwidth=bandwidth, latency=latency)


def _efficiency(data: Mapping[str, Any], file) -> SystemEfficiency:
    """The optional `efficiency:` block; every field optional, each defaulting to the identity."""
    raw = data.get("efficiency")
    if raw is None:
        return IDENTITY_EFFICIENCY
    if not isinstance(raw, dict):
        raise config_error(file, "efficiency", f"expected a mapping of {', '.join(EFFICIENCY_FIELDS)}, got {shown(raw)}")
    for key in raw:
        if key not in EFFICIENCY_FIELDS:
            # a flat per-iteration constant is not a parameter: the step's work is priced from its bytes
            why = " (the per-iteration work is priced from the bytes it moves)" if key == "iteration_overhead" else ""
            raise config_error(file, f"efficiency.{key}",
                               f"unknown field{why}; allowed fields are {', '.join(EFFICIENCY_FIELDS)}")
    fractions = {}
    for key in ("intra_node_bandwidth", "inter_node_bandwidth"):
        value = raw.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise config_error(file, f"efficiency.{key}", f"must be a fraction in (0, 1], got {shown(value)}")
        fractions[key] = float(value)
    per_microbatch = parse_quantity(raw.get("microbatch_overhead", 0.0), _TIME_UNITS, file,
                                    "efficiency.microbatch_overhead", allow_zero=True)
    if per_microbatch > 1:  # 1 s per schedule step is 1000x a slow one (~1 ms)
        raise config_error(file, "efficiency.microbatch_overhead",
                           f"must be at most 1 s per microbatch and stage, got {per_microbatch} s")
    return SystemEfficiency(microbatch_overhead_s=per_microbatch, **fractions)


REQUIRED = ("devices_per_node", "intra_node", "inter_node")
OPTIONAL = ("name", "description", "accelerators", "global_batch", "precision", "optimizer", "optimizer_memory",
            "efficiency", "nics_per_node", "torus")
# With a torus the slice is the node: its chip count and link replace devices_per_node and intra_node.
TORUS_DERIVED = ("devices_per_node", "intra_node")


def _torus_network(data: Mapping[str, Any], file) -> tuple[dict, Torus | None]:
    """`data` with a torus block turned into the node fields it stands for (module docstring), and
    the torus; a file without one is returned as it is."""
    if "torus" not in data:
        return data, None
    for key in TORUS_DERIVED:
        if key in data:
            raise config_error(file, key, "not allowed with torus (the torus's chip count and link set it)")
    torus, raw_link = parse_torus(data["torus"], file)
    if torus.size > MAX_ACCELERATORS:
        raise config_error(file, "torus.dims", f"must hold at most {MAX_ACCELERATORS} chips, got {torus.size}")
    link = _link({}, "torus.link", file, raw=raw_link)
    rest = {k: v for k, v in data.items() if k != "torus"}
    return {**rest, "devices_per_node": torus.size, "intra_node": {"bandwidth": link.bandwidth,
                                                                   "latency": link.latency}}, torus


def system_from_dict(data: Mapping[str, Any], file="<system>") -> System:
    data, torus = _torus_network(data, file)
    check_keys(data, file, REQUIRED, OPTIONAL)
    name = data.get("name", Path(str(file)).stem)
    if not isinstance(name, str) or not name:
        raise config_error(file, "name", f"must be a non-empty string, got {shown(name)}")
    accelerators = positive_int(data, "accelerators", file, default=1024, limit=LIMITS["accelerators"])
    devices_per_node = positive_int(data, "devices_per_node", file, limit=LIMITS["devices_per_node"])
    global_batch = positive_int(data, "global_batch", file, default=4096, limit=LIMITS["global_batch"])
    precision = one_of(data, "precision", file, PRECISIONS, default="bf16")
    optimizer = one_of(data, "optimizer", file, OPTIMIZERS, default="adam")
    optimizer_memory = one_of(data, "optimizer_memory", file, OPTIMIZER_MEMORY, default="mixed_precision")
    intra = _link(data, "intra_node", file)
    nic = _link(data, "inter_node", file)  # one NIC
    # A DGX has one compute NIC per GPU; 8 per device is beyond any node built.
    nics = positive_int(data, "nics_per_node", file, default=devices_per_node,
                        limit=Limit(8 * devices_per_node, "8 NICs per device, beyond any node built"))
    inter = Link(nic.bandwidth * nics / devices_per_node, nic.latency)  # one device's share
    # The device layout puts the busiest traffic inside nodes; that only pays if the node's link is
    # not the slower one, and the placement DP's pruning of data-parallel degrees relies on it.
    fast = "intra_node" if torus is None else "torus.link"
    if intra.bandwidth < inter.bandwidth:
        raise config_error(file, f"{fast}.bandwidth",
                           "must be at least inter_node.bandwidth x nics_per_node / devices_per_node")
    if intra.latency > inter.latency:
        raise config_error(file, f"{fast}.latency", "must be at most inter_node.latency")
    efficiency = _efficiency(data, file)
    system = System(
        name=name,
        accelerators=accelerators,
        devices_per_node=devices_per_node,
        intra_node=intra,
        inter_node=inter,
        global_batch=global_batch,
        precision=precision,
        optimizer=optimizer,
        optimizer_memory=optimizer_memory,
        path=str(file),
        nics_per_node=nics if nics != devices_per_node else 0,
        torus=torus,
    )
    if efficiency.is_identity:
        return system
    system = system.with_efficiency(efficiency)
    if system.intra_node.bandwidth < system.inter_node.bandwidth:
        raise config_error(file, "efficiency.intra_node_bandwidth",
                           "leaves the achieved intra-node bandwidth below the inter-node one")
    return system


def load_system(name_or_path: str | os.PathLike | System = "default") -> System:
    """Load and validate a system config by name (`configs/systems/`) or path."""
    if isinstance(name_or_path, System):
        return name_or_path
    data, path = configs.load("systems", name_or_path)
    return system_from_dict(data, path)
