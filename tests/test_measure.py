"""`phaze-opt measure`: the traced block materialised and timed on the CPU at a tiny size.

The checks: the JSON has the truth file's form and loads as a layer validation suite's data; the
materialised module does the modelled work (its matmul FLOPs, counted by PyTorch while it runs, equal
the GEMM FLOPs of the graph traced on the meta device, at several TP widths, both families and both
attention kernels); no collective is timed; bad input is one line with no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn.attention import SDPBackend, sdpa_kernel

from phaze_opt import cli
from phaze_opt.errors import PhazeError
from phaze_opt.validation import measure as M
from phaze_opt.validation.suites import GEMM_KEYS, LAYER_KEYS, load_suite
from phaze_opt.workload import collectives
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.models import load_model
from conftest import error_lines

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "phaze_opt" / "presets"
TRUTH = REPO / "phaze_opt" / "presets" / "validation" / "truth" / "h100-blocks.json"
CPU = torch.device("cpu")

TINY = {  # GPT-3's kind of block (learned positions, GELU, LayerNorm, biases, dropout 0.1) at a toy size
    "tiny-gpt": {"name": "tiny-gpt", "family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32,
                 "vocab": 101, "activation": "gelu", "norm": "layernorm", "position": "learned",
                 "tied_embeddings": True, "expert_placement": {"tp": 1, "pp": 1, "dp": 8}},
    # Llama-2 70B's kind: grouped-query attention (8 query heads on 4 KV heads), rotary, SwiGLU, RMSNorm,
    # no biases, no dropout
    "tiny-llama": {"name": "tiny-llama", "family": "llama", "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 4,
                   "ffn": 96, "seq": 32, "vocab": 101, "activation": "swiglu", "norm": "rmsnorm",
                   "position": "rotary", "tied_embeddings": False, "bias": False, "dropout": 0.0,
                   "expert_placement": {"tp": 1, "pp": 1, "dp": 8}},
}


@pytest.fixture
def configs(tmp_path, monkeypatch, request):
    """The shipped configs plus the tiny models, so that a suite can name them (suites take shipped names)."""
    root = tmp_path / "configs"
    root.mkdir()
    for sub in SHIPPED.iterdir():
        if sub.is_dir() and sub.name != "models":
            (root / sub.name).symlink_to(sub, target_is_directory=True)
    models = root / "models"
    models.mkdir()
    for f in (SHIPPED / "models").glob("*.yaml"):
        (models / f.name).symlink_to(f)
    for name, data in TINY.items():
        (models / f"{name}.yaml").write_text(yaml.safe_dump(data))
    for f in SHIPPED.glob("*.*"):  # the constants files beside the folders
        (root / f.name).symlink_to(f)
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(root))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CPU: a descheduled worker thread would stall every tiny op
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    return root


def _measure(name, tp=1, mbs=1, **kw):
    kw = {"device": "cpu", "repeats": 3, "warmup": 1, **kw}
    return M.measure(load_model(name), tp, mbs, **kw)


def test_output_has_the_truth_files_form_and_loads_as_a_suite(configs, tmp_path, capsys):
    out = tmp_path / "mine.json"
    code = cli.main(["measure", "--model", "tiny-gpt", "--device", "cpu", "--tp", "2", "--mbs", "2",
                     "--attention", "unfused", "flash", "--repeats", "3", "--warmup", "1", "--gemms", "--out", str(out)])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "wrote" in text and "tiny-gpt" in text
    data, truth = json.loads(out.read_text()), json.loads(TRUTH.read_text())
    assert set(truth) <= set(data)  # device, torch, measured, gemm, layers
    assert {type(data[k]) for k in ("device", "torch", "measured")} == {str}
    assert data["dtype"] == "bf16" and data["timing"] == "perf_counter" and data["repeats"] == 3
    assert "summary" not in data
    # the truth file's keys, and how the kernels ran (absent from the shipped H100 file: eager)
    assert [sorted(r) for r in data["layers"]] == [sorted([*truth["layers"][0], "kernels"])] * 2 \
        == [sorted([*LAYER_KEYS, "kernels"])] * 2
    assert {r["kernels"] for r in data["layers"]} == {"eager"}
    assert {tuple(g) for g in data["gemm"]} == {tuple(truth["gemm"][0])} == {GEMM_KEYS}
    assert [(r["tp"], r["flash"]) for r in data["layers"]] == [(2, False), (2, True)]
    for r in data["layers"]:
        assert r["model"] == "tiny-gpt" and r["mbs"] == 2
        assert r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["fwd_bwd_s"] == pytest.approx(r["fwd_s"] + r["bwd_s"])
    # the block's four linear layers at TP 2, once for both kernels (64 tokens: 2 sequences of 32)
    shapes = [(g["M"], g["N"], g["K"]) for g in data["gemm"]]
    assert shapes == [(64, 96, 64), (64, 64, 32), (64, 128, 64), (64, 64, 128)]
    assert all(g["s"] > 0 and g["tflops"] == pytest.approx(2 * g["M"] * g["N"] * g["K"] / g["s"] / 1e12)
               for g in data["gemm"])

    suite_file = tmp_path / "mine.yaml"
    suite_file.write_text(yaml.safe_dump({
        "suite": "mine", "description": "tiny blocks on this CPU", "arch": "h100-sxm", "metric": "layer_seconds",
        "papers": {"cpu": "measured here by phaze-opt measure"}, "data": "mine.json",
        "source": {"paper": "cpu", "table": "mine.json layers"},
    }))
    suite = load_suite(suite_file)
    assert [(r.model, r.tp, r.microbatch, r.flash) for r in suite.rows] == \
        [("tiny-gpt", r["tp"], 2, r["flash"]) for r in data["layers"]]
    assert [r.fwd_s for r in suite.rows] == [r["fwd_s"] for r in data["layers"]]
    assert [(g.m, g.n, g.k) for g in suite.gemms] == [(g["M"], g["N"], g["K"]) for g in data["gemm"]]


TINY_MOE = {  # Qwen3-MoE's kind of block at a toy size: 4 routed experts, top 2, GQA, SwiGLU, no shared expert
    "name": "tiny-moe", "family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96,
    "seq": 16, "vocab": 101, "activation": "swiglu", "norm": "rmsnorm", "position": "rotary",
    "tied_embeddings": False, "bias": False, "dropout": 0.0, "experts": 4, "top_k": 2, "expert_ffn": 32,
    "expert_placement": {"tp": 1, "pp": 1, "dp": 8},
}


def test_moe_block_backward_includes_its_balancing_loss(configs, tmp_path):
    """A MoE block returns (output, load-balancing loss): the timed backward must take the tuple (a
    plain `.backward` on it fails) and reach every parameter, the router's included."""
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(yaml.safe_dump(TINY_MOE))
    model = load_model(str(path))
    block = M.materialise_block(model, 1, 1, CPU, "fp32")
    out = block.module(block.x)
    assert isinstance(out, tuple) and out[1].requires_grad
    router = [p for n, p in block.module.named_parameters() if "router" in n or "gate" in n.split(".")[-2:][0]]
    block.forward_backward()
    assert block.x.grad is not None and all(p.grad is not None for p in block.module.parameters() if p.requires_grad)
    assert router, "the tiny MoE block has a router"


def test_unknown_kernels_is_one_line(configs):
    with pytest.raises(PhazeError, match="--kernels must be one of eager, inductor, got 'jit'"):
        _measure("tiny-gpt", kernels=("jit",))


def _counted_and_traced(name, tp, mbs, attention):
    model = M.with_attention(load_model(name), attention)
    block = M.materialise_block(model, tp, mbs, CPU, "fp32")
    with sdpa_kernel(SDPBackend.MATH):  # the math backend is made of bmm's a FLOP counter sees
        counted = M.counted_flops(block)
    graph = build_layer_graph(model, tp, mbs)
    return counted, M.traced_gemm_flops(graph), graph


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_materialised_block_does_the_traced_graphs_gemm_work(configs, name, tp):
    (fwd, bwd), (traced_fwd, traced_bwd), graph = _counted_and_traced(name, tp, 2, "unfused")
    assert fwd == traced_fwd and bwd == traced_bwd
    # and that work is the model's: 2 x tokens x the shard's weights forward (+ the attention core), twice that backward
    m = load_model(name)
    tokens, d = 2 * m.seq, m.head_dim
    width = (m.heads + 2 * m.kv_heads) * d + m.heads * d + (3 if m.activation == "swiglu" else 2) * m.ffn
    core = 2 * 2 * (m.heads // tp) * 2 * m.seq * m.seq * d  # Q K^T and P V
    assert traced_fwd == 2 * tokens * m.hidden * width // tp + core
    assert traced_bwd == 2 * traced_fwd
    assert M.collective_ops(graph) == (0 if tp == 1 else 4)  # f and g of both sublayers, left out when timed


@pytest.mark.parametrize("name", sorted(TINY))
def test_flash_block_matches_the_traced_fused_op_but_its_recompute(configs, name):
    """SDPA's math backend keeps the probabilities instead of recomputing Q K^T in backward, as the
    FlashAttention kernel (and the traced op, Dao 2023 Alg. 2) does: one score GEMM fewer, no other difference."""
    (fwd, bwd), (traced_fwd, traced_bwd), graph = _counted_and_traced(name, 2, 2, "flash")
    (attn,) = [op for op in graph.op_graphs["block"]["bwd"].ops if op.gemms]
    b, m, k, n = attn.gemms[0]  # the recomputed S = Q K^T
    assert fwd == traced_fwd and bwd == traced_bwd - 2 * b * m * k * n


def test_sdpa_stand_in_is_exact_attention(configs):
    """The fused-attention stand-in computes what the traced op's reference kernel computes (no dropout)."""
    torch.manual_seed(0)
    kv, g, b, s, d = 2, 3, 2, 5, 4
    q, k, v = torch.randn(b * kv, s * g, d), torch.randn(b * kv, s, d), torch.randn(b * kv, s, d)
    want, _ = torch.ops.phaze.flash_attention(q, k, v, kv, g, True, 0.0, 0.5)
    got, _ = M._sdpa_attention(q, k, v, kv, g, True, 0.0, 0.5)
    assert got.shape == want.shape == (s, b, kv, g, d)
    torch.testing.assert_close(got, want)


def test_no_collective_runs_while_measuring(configs, monkeypatch):
    calls = []
    real = collectives.allreduce

    def spy(x, *args):
        if x.device.type != "meta":  # tracing the modelled graph (on meta) has them, as it should
            calls.append(x.shape)
        return real(x, *args)

    monkeypatch.setattr(collectives, "allreduce", spy)
    r = _measure("tiny-llama", tp=2)
    assert calls == [] and r["layers"][0]["tp"] == 2
    assert r["summary"][0]["collectives_left_out"] == 4
    # the swap is undone: the module traces its all-reduces as before
    from phaze_opt.workload import layers
    assert layers.reduce_from_tp is collectives.reduce_from_tp and layers.copy_to_tp is collectives.copy_to_tp


def test_cuda_without_a_gpu_is_one_line(configs):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(PhazeError) as exc:
        _measure("tiny-gpt", device="cuda")
    assert str(exc.value) == M.NO_CUDA


def test_noise_bound_timings_are_skipped_not_a_negative_backward(configs, monkeypatch):
    seconds = iter([2.0, 1.0, 1.0, 3.0])  # (forward, forward+backward) medians of two configurations
    monkeypatch.setattr(M, "time_cpu", lambda fn, warmup, repeats: M.Timed(next(seconds), "perf_counter"))
    r = _measure("tiny-gpt", mbs=[1, 2])
    assert [(row["mbs"], row["fwd_s"], row["bwd_s"]) for row in r["layers"]] == [(2, 1.0, 2.0)]
    assert [s["mbs"] for s in r["skipped"]] == [1] and "raise --repeats" in r["skipped"][0]["reason"]
    seconds = iter([2.0, 2.0])
    with pytest.raises(PhazeError, match="nothing measured: tiny-gpt tp 1 mbs 1: .* raise --repeats"):
        _measure("tiny-gpt")


def test_out_of_memory_skips_the_configuration(configs, monkeypatch):
    real = M.materialise_block

    def fail_at_tp2(model, tp, *args, **kw):
        if tp == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(model, tp, *args, **kw)

    monkeypatch.setattr(M, "materialise_block", fail_at_tp2)
    r = _measure("tiny-gpt", tp=[1, 2])
    assert [row["tp"] for row in r["layers"]] == [1]
    assert r["skipped"] == [{"model": "tiny-gpt", "tp": 2, "mbs": 1, "flash": False, "kernels": "eager",
                             "reason": f"out of memory on {M.device_name(CPU)} (try a larger --tp or a smaller --mbs)"}]
    with pytest.raises(PhazeError, match="nothing measured: tiny-gpt tp 2 mbs 1: out of memory"):
        _measure("tiny-gpt", tp=2)


BAD = [
    (["--model", "nope", "--device", "cpu"], "unknown model 'nope'"),
    (["--model", "tiny-gpt", "--device", "cpu", "--tp", "3"],
     "measure: --tp 3: model tiny-gpt shards over TP widths 1, 2, 4 only"),
    (["--model", "tiny-gpt", "--device", "cpu", "--mbs", "0"], "--mbs must be a positive integer, got 0"),
    (["--model", "tiny-gpt", "--device", "cpu", "--repeats", "0"], "--repeats must be a positive integer"),
    (["--model", "tiny-gpt", "--device", "cpu", "--warmup", "-1"], "--warmup must be a non-negative integer"),
    (["--model", "tiny-gpt", "--device", "cpu", "--out", "."], "--out .: is a folder"),
] + ([] if torch.cuda.is_available() else [(["--model", "tiny-gpt"], M.NO_CUDA)])


@pytest.mark.parametrize("argv, words", BAD)
def test_bad_input_is_one_line(configs, tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["measure", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err


def test_bad_input_from_the_command_line_has_no_traceback(configs, tmp_path):
    """The console command itself, in a fresh process (each costs a few seconds of torch import)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for argv, words in (BAD[1], BAD[-1]):
        proc = subprocess.run([sys.executable, "-m", "phaze_opt", "measure", *argv], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert len(error_lines(proc.stderr)) == 1 and words in proc.stderr and "Traceback" not in proc.stderr
        assert proc.stdout == ""


class _FakeCuda:
    """Just enough of torch.cuda to follow `time_cuda`'s order of calls without a GPU: a clock that
    the timed function and graph replays advance, events that read it, a capture that may fail."""

    def __init__(self, capture_error=None):
        self.log, self.now, self.side, self.capturing = [], 0.0, False, False
        self.capture_error = capture_error
        fake = self

        class Stream:
            def wait_stream(self, other):
                fake.log.append("wait")

        class Graph:
            def replay(self):
                fake.log.append("replay")
                fake.now += 2.0

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                self.t = fake.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3  # milliseconds, as CUDA events report

        @contextmanager
        def stream(s):
            fake.side = True
            yield
            fake.side = False

        @contextmanager
        def graph(g):
            fake.log.append("capture")
            fake.capturing = True
            yield
            fake.capturing = False
            if fake.capture_error:
                raise RuntimeError(fake.capture_error)

        self.attrs = {"Stream": Stream, "stream": stream, "current_stream": lambda: Stream(), "CUDAGraph": Graph,
                      "graph": graph, "Event": Event, "synchronize": lambda: fake.log.append("sync")}

    def fn(self):
        self.log.append("side" if self.side else "capture-run" if self.capturing else "eager")
        self.now += 1.0


@pytest.mark.parametrize("error", [None, "operation not permitted when stream is capturing"])
def test_cuda_timing_warms_up_on_a_side_stream_then_replays_a_graph_or_falls_back(monkeypatch, error):
    fake = _FakeCuda(error)
    for name, value in fake.attrs.items():
        monkeypatch.setattr(torch.cuda, name, value)
    timed = M.time_cuda(fake.fn, warmup=2, repeats=5)
    log = [e for e in fake.log if e not in ("wait", "sync")]
    assert log[:3] == ["side", "side", "capture"]  # warm-up on the side stream, before the capture
    if error is None:
        assert timed == M.Timed(2.0, "cuda-graph")
        assert log[3:] == ["capture-run"] + ["replay"] * 7  # 2 warm-up replays, 5 timed
    else:
        assert timed.seconds == 1.0 and timed.method == f"cuda-events (eager: CUDA graph capture failed: {error})"
        assert log[3:] == ["capture-run"] + ["eager"] * 7
    assert M.time_cuda(fake.fn, warmup=0, repeats=1, graphs=False).method == "cuda-events (eager)"
