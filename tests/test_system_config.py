"""System configs: the shipped presets, unit parsing, memory accounting, link rules, and one-line errors."""

import math

import pytest
import yaml

from phaze_opt.errors import PhazeError
from phaze_opt.training import Training
from phaze_opt.system import Link, System, load_system, system_from_dict

GOOD = {
    "name": "mine",
    "accelerators": 64,
    "devices_per_node": 8,
    "intra_node": {"bandwidth": "300 GB/s", "latency": "1 us"},
    "inter_node": {"bandwidth": "200 Gbit/s", "latency": "5 us"},
    "global_batch": 512,
    "precision": "bf16",
    "optimizer": "adam",
    "optimizer_memory": "mixed_precision",
}


def write(tmp_path, data, name="sys.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_default_preset():
    s = load_system()
    assert s.name == "default"
    assert s.accelerators == 1024 and s.devices_per_node == 8 and s.global_batch == 4096
    assert s.intra_node == Link(300e9, 1e-6)
    assert s.inter_node.bandwidth == 25e9 and math.isclose(s.inter_node.latency, 5e-6)
    assert s.precision == "bf16" and s.bytes_per_element == 2
    assert s.state_bytes_per_param == 16  # mixed-precision Adam
    assert s.grad_bytes_per_param == 2


def test_phaze_preset_is_a_flat_4_gib_network():
    s = load_system("phaze")
    assert s.accelerators == 1024 and s.global_batch == 4096 and s.bytes_per_element == 2
    assert s.intra_node.bandwidth == s.inter_node.bandwidth == 4 * 2**30
    assert s.intra_node.latency == s.inter_node.latency == 0.0
    # weights + gradients + one more copy for Adam, 2 bytes each
    assert s.state_bytes_per_param == 6
    # a flat network: every collective and transfer takes the same link
    for t in (1, 2, 4, 8, 16):
        assert s.tp_link(t).bandwidth == 4 * 2**30
        assert s.pipeline_link(t, 4).bandwidth == 4 * 2**30


@pytest.mark.parametrize(
    "precision, optimizer, accounting, expected",
    [
        ("bf16", "adam", "mixed_precision", 16),  # 2 + 2 + 4 master + 8 moments
        ("fp16", "adam", "mixed_precision", 16),
        ("fp32", "adam", "mixed_precision", 16),  # 4 + 4 + 8, no master copy
        ("bf16", "sgd", "mixed_precision", 8),  # 2 + 2 + 4 master
        ("fp32", "sgd", "mixed_precision", 8),
        ("bf16", "adam", "phaze", 6),
        ("bf16", "sgd", "phaze", 4),
        ("fp32", "adam", "phaze", 12),
    ],
)
def test_optimizer_memory_accounting(tmp_path, precision, optimizer, accounting, expected):
    data = {**GOOD, "precision": precision, "optimizer": optimizer, "optimizer_memory": accounting}
    s = load_system(write(tmp_path, data))
    assert s.state_bytes_per_param == expected
    assert s.grad_bytes_per_param == (4 if precision == "fp32" else 2)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4 GiB/s", 4 * 2**30),
        ("300 GB/s", 300e9),
        ("200 Gbit/s", 25e9),
        ("1.5e3 MB/s", 1.5e9),
        (12.5e9, 12.5e9),
    ],
)
def test_bandwidth_units(tmp_path, text, expected):
    fast = {"bandwidth": "1 TB/s", "latency": 0}
    s = load_system(write(tmp_path, {**GOOD, "intra_node": fast, "inter_node": {"bandwidth": text, "latency": 0}}))
    assert math.isclose(s.inter_node.bandwidth, expected)


@pytest.mark.parametrize(
    "text, expected", [("1 us", 1e-6), ("1 µs", 1e-6), ("500 ns", 5e-7), ("2 ms", 2e-3), (0, 0.0), ("0 s", 0.0)]
)
def test_latency_units(tmp_path, text, expected):
    slow = {"bandwidth": "1 GB/s", "latency": "1 s"}
    fast = {"bandwidth": "300 GB/s", "latency": text}
    s = load_system(write(tmp_path, {**GOOD, "intra_node": fast, "inter_node": slow}))
    assert math.isclose(s.intra_node.latency, expected, abs_tol=1e-15)


def test_defaults_for_optional_fields(tmp_path):
    data = {k: GOOD[k] for k in ("devices_per_node", "intra_node", "inter_node")}
    s = load_system(write(tmp_path, data, "bare.yaml"))
    assert s.name == "bare" and s.accelerators == 1024 and s.global_batch == 4096
    assert s.precision == "bf16" and s.optimizer == "adam" and s.optimizer_memory == "mixed_precision"


def test_link_rules_follow_the_device_layout():
    s = system_from_dict(GOOD)  # 8 devices per node
    intra, inter = s.intra_node, s.inter_node
    # TP groups: inside a node when the width divides the node
    assert s.tp_link(1) is intra and s.tp_link(8) is intra and s.tp_link(3) is inter
    # a group of whole nodes spreads its ring over the 8 NICs of each: 8 x 25 GB/s, below NVLink's 300
    assert s.tp_link(16) == s.tp_link(32) == Link(8 * inter.bandwidth, inter.latency)
    assert s.tp_link(16).bandwidth == 200e9
    # pipeline hops: inside a node only when a whole replica packs into nodes
    assert s.pipeline_link(2, 4) is intra and s.pipeline_link(1, 8) is intra
    assert s.pipeline_link(2, 3) is inter and s.pipeline_link(8, 2) is inter
    # data-parallel ring: inside a node only when the whole job is
    assert s.dp_link(1, 2, 4) is intra and s.dp_link(1, 2, 5) is inter and s.dp_link(8, 1, 2) is inter


def test_transfer_time():
    assert Link(10.0, 0.5).transfer_s(20.0) == 2.5


def test_system_passes_through():
    s = load_system()
    assert load_system(s) is s


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"colour": "red"}, "colour", "unknown field"),
        ({"accelerators": 0}, "accelerators", "positive integer"),
        ({"accelerators": 2.5}, "accelerators", "positive integer"),
        ({"devices_per_node": -8}, "devices_per_node", "positive integer"),
        ({"global_batch": "many"}, "global_batch", "positive integer"),
        ({"precision": "int8"}, "precision", "bf16"),
        ({"optimizer": "lamb"}, "optimizer", "adam"),
        ({"optimizer_memory": "zero3"}, "optimizer_memory", "mixed_precision"),
        ({"intra_node": {"bandwidth": "0 GB/s", "latency": 0}}, "intra_node.bandwidth", "positive"),
        ({"intra_node": {"bandwidth": "-3 GB/s", "latency": 0}}, "intra_node.bandwidth", "number"),
        ({"inter_node": {"bandwidth": "3 furlongs/s", "latency": 0}}, "inter_node.bandwidth", "unknown unit"),
        ({"inter_node": {"bandwidth": "25 GB/s", "latency": -1}}, "inter_node.latency", "non-negative"),
        ({"inter_node": {"bandwidth": "25 GB/s", "latency": "soon"}}, "inter_node.latency", "number"),
        ({"inter_node": {"bandwidth": "25 GB/s"}}, "inter_node.latency", "missing"),
        ({"inter_node": {"bandwidth": "25 GB/s", "latency": 0, "mtu": 9000}}, "inter_node.mtu", "unknown field"),
        ({"inter_node": "fast"}, "inter_node", "mapping"),
        ({"inter_node": {"bandwidth": "400 GB/s", "latency": "1 us"}}, "intra_node.bandwidth", "at least"),
        ({"intra_node": {"bandwidth": "300 GB/s", "latency": "9 us"}}, "intra_node.latency", "at most"),
        ({"name": ""}, "name", "non-empty"),
    ],
)
def test_bad_fields_are_one_line_errors(tmp_path, change, field, words):
    path = write(tmp_path, {**GOOD, **change})
    with pytest.raises(PhazeError) as info:
        load_system(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and f"'{field}'" in message and words in message


def test_missing_required_field(tmp_path):
    data = dict(GOOD)
    del data["devices_per_node"]
    with pytest.raises(PhazeError, match=r"'devices_per_node': missing required field"):
        load_system(write(tmp_path, data))


def test_unknown_system_name_lists_choices():
    with pytest.raises(PhazeError, match=r"unknown system 'nope'; choose one of .*default.*phaze"):
        load_system("nope")


def test_system_is_frozen():
    s = load_system()
    with pytest.raises(Exception):
        s.accelerators = 3  # type: ignore[misc]
    assert isinstance(s, System)


@pytest.mark.parametrize("field, value, limit", [
    ("accelerators", 1073741824, "1,048,576"),
    ("devices_per_node", 2**21, "1,048,576"),
    ("global_batch", 2**30, "16,777,216"),
])
def test_sizes_beyond_any_cluster_are_refused_on_load(tmp_path, field, value, limit):
    path = write(tmp_path, {**GOOD, field: value})
    with pytest.raises(PhazeError) as info:
        load_system(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"'{field}'" in message
    assert f"must be at most {limit}" in message and f"got {value:,}" in message


def test_the_largest_cluster_allowed_loads_and_places_without_per_device_arrays(monkeypatch):
    """At the accelerator limit the placement's data-parallel degrees are walked by distinct
    microbatch counts (O(sqrt(batch))), never as an array of every degree."""
    import numpy as np

    from phaze_opt.solve.placement import dp as placement
    from phaze_opt.solve.placement.kernel import node_divisors
    from phaze_opt.system import LIMITS

    system = system_from_dict({**GOOD, "accelerators": LIMITS["accelerators"].maximum})
    real_arange = np.arange

    def small_arange(*args, **kw):
        out = real_arange(*args, **kw)
        assert out.size < 100_000, "an array as long as the accelerator count"
        return out

    monkeypatch.setattr(placement.np, "arange", small_arange)
    problem = type("P", (), {"system": system, "training": Training(1)})()
    d, m = placement._dp_degrees(problem, 1)
    # per microbatch count: its first degree and the first multiple of each divisor of a node (kernel.ring_degrees)
    per_count = 1 + len(node_divisors(system.devices_per_node))
    assert d[0] == 1 and m[-1] == 1 and len(d) <= (2 * math.isqrt(system.global_batch) + 1) * per_count
    assert np.all(-(-system.global_batch // d) == m)


def test_nics_per_node_default_keeps_the_old_meaning(tmp_path):
    """A file without nics_per_node has one NIC per device: inter_node is that NIC, as before."""
    s = load_system(write(tmp_path, GOOD))
    assert s.nics == 8 and s.nics_per_node == 0 and s.nic_bandwidth == s.inter_node.bandwidth == 25e9
    assert s.inter_node.latency == pytest.approx(5e-6) and "nics_per_node" not in s.summary()
    explicit = load_system(write(tmp_path, {**GOOD, "nics_per_node": 8}, "explicit.yaml"))
    assert explicit.inter_node == s.inter_node and explicit.tp_link(16) == s.tp_link(16)
    assert explicit.summary() == {**s.summary(), "name": explicit.name}


def test_fewer_nics_share_a_node_and_slow_what_crosses_it(tmp_path):
    """Four 200 Gbit/s NICs for 8 devices: each device's share is half a NIC; a TP group of whole nodes
    still spreads over all four; an all-to-all across nodes takes twice as long."""
    s = load_system(write(tmp_path, {**GOOD, "nics_per_node": 4}))
    one_each = load_system(write(tmp_path, GOOD, "one-each.yaml"))
    assert s.nics == 4 and s.nic_bandwidth == 25e9 and s.inter_node.bandwidth == 12.5e9
    assert s.tp_link(16).bandwidth == 4 * 25e9 == one_each.tp_link(16).bandwidth / 2
    assert s.alltoall_s(64e6, 16, 1) == pytest.approx(
        8 * (s.inter_node.latency + 4e6 / 12.5e9))  # 8 remote peers of 4 MB at half a NIC each
    assert s.summary()["nics_per_node"] == 4 and s.summary()["nic_bandwidth_bytes_per_s"] == 25e9


def test_dgx_presets_have_eight_nics_of_their_generation():
    """DGX H100: 8 x 400 Gbit/s NDR; DGX A100: 8 x 200 Gbit/s HDR (NVIDIA datasheets), achieved at the
    presets' NCCL fractions. A TP 16 ring over two DGX H100 nodes runs near NVLink speed, not one NIC's."""
    h100, a100 = load_system("dgx-h100"), load_system("dgx-a100")
    assert h100.nics == a100.nics == 8
    assert h100.nominal_inter_node.bandwidth == pytest.approx(50e9)
    assert a100.nominal_inter_node.bandwidth == pytest.approx(25e9)
    assert h100.tp_link(16).bandwidth == pytest.approx(min(0.82 * 450e9, 8 * 0.94 * 50e9))
    assert h100.tp_link(16).bandwidth > 7 * h100.inter_node.bandwidth


@pytest.mark.parametrize("value, words", [(0, "positive integer"), (2.5, "positive integer"), ("8", "positive integer"),
                                          (65, "at most 64")])
def test_bad_nics_per_node_is_a_one_line_error(tmp_path, value, words):
    path = write(tmp_path, {**GOOD, "nics_per_node": value})
    with pytest.raises(PhazeError) as info:
        load_system(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "'nics_per_node'" in message and words in message
