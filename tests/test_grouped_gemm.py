"""Grouped GEMMs (a MoE's experts) by tokens per expert, held against DeepGEMM's published kernel
timings on an H800 (truth/deepgemm-h800-fp8-2025.json): nothing is fitted on that table, so every
row is held out; and the template's limits, checked by enumeration over shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import estimate
from phaze_opt.workload.ops import Op, OpGraph

REPO = Path(__file__).resolve().parents[1]
TRUTH = REPO / "phaze_opt/presets/validation/truth/deepgemm-h800-fp8-2025.json"


def _kernel_chip():
    """h100-sxm as fitted, less its per-operator launch gap: DeepGEMM times the kernel alone
    (profiler kernel time), so the eager stack's dispatch gap between kernels is not in it."""
    chip = load_arch("h100-sxm")
    return dataclasses.replace(chip, efficiency=dataclasses.replace(chip.efficiency, op_overhead_s=0.0))


def _gemm(groups, m, k, n, datatype="", operand_bytes=2):
    """One (grouped) GEMM op: `groups` experts of m tokens each, K x N weights per expert."""
    return Op("mm", "grouped_gemm" if groups > 1 else "gemm", "tc", flops=2.0 * groups * m * k * n,
              bytes_read=groups * (m * k + k * n) * operand_bytes, bytes_written=groups * m * n * 2,
              gemm=(groups, m, k, n), datatype=datatype)


def _seconds(ops, chip):
    return estimate(OpGraph("block", "fwd", tuple(ops), ()), [chip]).split[0]


def _truth():
    return json.loads(TRUTH.read_text())


def test_the_truth_file_is_the_readme_table():
    data = _truth()
    assert data["commit"] == "989c9e3694638dd02aa36b4d8cb42339305caa85" and "H800" in data["device"]
    assert len(data["dense"]) == 18 and len(data["grouped"]) == 10
    assert {r["M"] for r in data["grouped"]} == {256, 512, 1024, 4096, 8192}


def _errors(rows, grouped):
    chip = _kernel_chip()
    ops = [_gemm(r["groups"] if grouped else 1, r["M"], r["K"], r["N"], "fp8", 1) for r in rows]
    published = [2.0 * (r["groups"] if grouped else 1) * r["M"] * r["N"] * r["K"] / (r["tflops"] * 1e12) for r in rows]
    return [float(t / p - 1.0) for t, p in zip(_seconds(ops, chip), published)]


def test_grouped_kernels_follow_the_published_tokens_per_expert():
    """256 to 8192 tokens per expert, FP8 on H800 (H100 SXM's SMs and HBM3): the template's fold
    fill and drain per group (the share of a fold's cycles not streaming rows falls as a group's
    rows grow) reproduces every published grouped row within 25%, 10% on the mean."""
    errors = _errors(_truth()["grouped"], grouped=True)
    assert max(abs(e) for e in errors) < 0.25
    assert sum(abs(e) for e in errors) / len(errors) < 0.10


def test_small_dense_kernels_within_the_stated_bound():
    """The dense rows (M 64, 128, 4096): the template is too slow at M 64-128, where a kernel's
    weight stream at a GEMM's HBM rate sets the time (the preset's hbm_fraction is the element-wise
    kernels'), by at most 35%; this bound is the known gap, so a change that widens it fails."""
    errors = _errors(_truth()["dense"], grouped=False)
    assert max(abs(e) for e in errors) < 0.36
    assert sum(abs(e) for e in errors) / len(errors) < 0.20


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16, 64, 128, 256]), st.sampled_from([512, 768, 2048, 4096, 7168]),
       st.sampled_from([192, 768, 1536, 2048, 4096, 7168]))
def test_more_tokens_per_expert_never_slower_per_token(groups, k, n):
    """For a fixed set of experts, the time per routed token never grows with the tokens each
    expert receives (32 to 32768): a group's fills and drains and its weights are paid once
    however many rows stream through, so efficiency follows tokens per expert."""
    chip = _kernel_chip()
    ms = [2**i for i in range(5, 16)]
    per_token = _seconds([_gemm(groups, m, k, n) for m in ms], chip) / ms
    assert all(b <= a * (1 + 1e-12) for a, b in zip(per_token, per_token[1:]))


@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048), (7168, 4096)])
def test_many_tokens_per_expert_reach_the_dense_gemm(k, n):
    """With many tokens per expert a grouped GEMM runs at the rate of one dense GEMM of the same
    rows (same weights per group, so compare per group): the per-group fills vanish against the
    stream, within 1% at 65536 rows a group."""
    chip = _kernel_chip()
    m = 65536
    grouped, dense = _seconds([_gemm(8, m, k, n), _gemm(1, m, k, n)], chip)
    assert grouped / 8 == pytest.approx(dense, rel=0.01)
    small, = _seconds([_gemm(8, 64, k, n)], chip)
    assert small / (8 * 64) > 1.2 * grouped / (8 * m)  # and at 64 tokens each, slower per token
