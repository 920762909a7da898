"""The model's layers as real `torch.nn.Module`s on the meta device, sharded the Megatron way.

A transformer is built per layer kind, never whole: the embedding, one transformer block (all blocks
are identical, so one module stands for all of them) and the head (final norm, LM or masked-LM
projection and the loss). Parameters live on the meta device: shapes and dtypes only, no memory, so
a GPT-3 block costs nothing to build.

Tensor parallelism of width t follows Megatron-LM (Shoeybi et al. 2019, Sec. 3; Narayanan et al. 2021):

- attention: a column-parallel QKV projection (heads/t query heads and kv_heads/t KV heads per device),
  attention on the local heads, a row-parallel output projection, all-reduce (`g`), then the
  replicated output bias, dropout and the residual add;
- MLP: column-parallel first linear (ffn/t columns; gate and up for SwiGLU), the activation, a
  row-parallel second linear, all-reduce (`g`);
- `f` (all-reduce in backward) on the input of every column-parallel linear;
- embedding: vocabulary-parallel (ceil(V/t) rows per device, out-of-range tokens masked, all-reduce);
  position and token-type tables, norms and row-parallel biases are replicated;
- head: the projection onto the vocabulary is column-parallel and the cross-entropy is Megatron's
  vocabulary-parallel one (all-reduces of the max, of the picked logit and of the sum of exponentials).

Activations use Megatron's [sequence, batch, hidden] layout, so the attention's Q, K and V are strided
views of the QKV output and the backward pass saves exactly what Megatron saves. Token ids and labels
are int64 [seq, batch]; everything else uses the model's dtype. The vocabulary-parallel code is
written for rank 0 of the TP group (every rank does the same work on the same shapes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import copy_to_tp, reduce_from_tp
from ..training import EXPERT_WEIGHTS
from .kinds import (BLOCK_KINDS, KINDS, LAYERNORM_LINEAR, attention_kind, block_kind,  # noqa: F401  (layers' face)
                    layer_kinds, layer_sequence, routed_kind)
from .models import ModelConfig

META = torch.device("meta")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _param(dtype, *shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=META, dtype=dtype))


def _shard(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} ({n}) is not divisible by the TP width {t}")
    return n // t


def vocab_rows(model: ModelConfig, t: int) -> int:
    """Rows of the vocabulary each device holds: Megatron pads the vocabulary to a multiple of t."""
    return -(-model.vocab // t)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout whose mask is a 1-byte bool tensor (what autograd saves), as on GPUs."""
    if p == 0:
        return x
    out, _mask = torch.ops.aten.native_dropout(x, p, True)
    return out


class LayerNorm(nn.Module):
    def __init__(self, h: int, eps: float, dtype):
        super().__init__()
        self.weight, self.bias, self.eps = _param(dtype, h), _param(dtype, h), eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (Zhang & Sennrich 2019), written out as the reference implementation does."""

    def __init__(self, h: int, eps: float, dtype):
        super().__init__()
        self.weight, self.eps = _param(dtype, h), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(model: ModelConfig, dtype) -> nn.Module:
    cls = RMSNorm if model.norm == "rmsnorm" else LayerNorm
    return cls(model.hidden, model.norm_eps, dtype)


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: each device computes out/t outputs from the full input."""

    parallel = "column"  # read by the tracer: the output starts Megatron's tensor-parallel region

    def __init__(self, n_in: int, n_out: int, t: int, bias: bool, dtype, what: str):
        super().__init__()
        local = _shard(n_out, t, what)
        self.weight = _param(dtype, local, n_in)
        self.bias = _param(dtype, local) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: partial sums all-reduced over the group; the bias is replicated
    and returned separately so that the caller adds it after the reduction (Megatron fuses it with
    dropout and the residual add). `reduce = False` leaves the sum to the caller (a parallel block
    adds attention's and the MLP's partial sums and all-reduces once)."""

    parallel = "row"  # read by the tracer: the output leaves Megatron's tensor-parallel region
    reduce = True

    def __init__(self, n_in: int, n_out: int, t: int, bias: bool, dtype, what: str):
        super().__init__()
        self.t = t
        self.weight = _param(dtype, n_out, _shard(n_in, t, what))
        self.bias = _param(dtype, n_out) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight)
        return (reduce_from_tp(y, self.t) if self.reduce else y), self.bias


class ReplicatedLinear(nn.Module):
    """Y = X A with A whole on every device of the group: MLA's down-projections, which Megatron-Core
    keeps duplicated across TP ranks (its `linear_q_down_proj` / `linear_kv_down_proj`)."""

    def __init__(self, n_in: int, n_out: int, dtype):
        super().__init__()
        self.weight = _param(dtype, n_out, n_in)

    def forward(self, x):
        return F.linear(x, self.weight)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_tables(s: int, d: int, dtype, device):
    """cos/sin of rotary embeddings (Su et al. 2021), [s, d]; constants of the sequence length."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# --- fused attention -------------------------------------------------------------------------------
#
# FlashAttention (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with
# IO-Awareness", NeurIPS 2022; Dao, "FlashAttention-2", 2023) computes softmax(Q K^T * scale) V in
# tiles held on chip: the s x s scores never reach memory, the forward keeps only the output O and the
# row-wise log-sum-exp L (float32), and the backward recomputes the scores from Q, K and L. Two custom
# operators stand for the two kernels, so each traces as one node (trace.py costs them). q is
# [B, s*g, d] with B = batch x KV heads and the g query heads of a KV group stacked along the rows
# (row r is position r // g), k and v are [B, s, d]; the output is written straight into Megatron's
# [s, b, KV heads, g, d] layout (as Transformer Engine's "sbhd" format does), so the output
# projection reads it as a view and the block keeps one copy of it. Dropout on the probabilities is
# applied inside the kernel from a regenerated random stream (no mask is kept); the reference
# implementation below, used off the meta device, is exact attention without dropout.


def _flash_rows(q, kv_heads: int, g: int):
    B, rows, d = q.shape
    return B // kv_heads, rows // g, d


# A sliding window (ModelConfig.window) is the kernels' trailing `window` argument: each query sees
# the `window` latest keys up to itself (0: all of them). Existing graphs trace without it.
@torch.library.custom_op("phaze::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, g: int, causal: bool,
                    p: float, scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [s, b, kv_heads, g, dv], log-sum-exp [B, s*g] float32) of exact attention."""
    b, s, _ = _flash_rows(q, kv_heads, g)
    qf, kf, vf = _wide(q, k, v)
    scores = _scores(qf, kf, scale, causal, s, g, window)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]), vf)
    return _to_sbhd(out.to(q.dtype), b, kv_heads, s, g, v.shape[-1]), lse.float()


@flash_attention.register_fake
def _flash_attention_fake(q, k, v, kv_heads, g, causal, p, scale, window=0):
    b, s, _ = _flash_rows(q, kv_heads, g)
    return q.new_empty(s, b, kv_heads, g, v.shape[-1]), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("phaze::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, kv_heads: int, g: int, causal: bool, p: float,
                             scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV): the scores recomputed from Q, K and L; dS = P * (dP - rowsum(dO * O))."""
    b, s, d = _flash_rows(q, kv_heads, g)
    qf, kf, vf, do, o = _wide(q, k, v, _from_sbhd(dout), _from_sbhd(out))
    scores = _scores(qf, kf, scale, causal, s, g, window)
    probs = torch.exp(scores - lse[..., None].to(scores.dtype))
    dv = torch.bmm(probs.transpose(1, 2), do)
    dp = torch.bmm(do, vf.transpose(1, 2))
    ds = probs * (dp - (do * o).sum(-1, keepdim=True)) * scale
    return torch.bmm(ds, kf).to(q.dtype), torch.bmm(ds.transpose(1, 2), qf).to(k.dtype), dv.to(v.dtype)


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, kv_heads, g, causal, p, scale, window=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup_context(ctx, inputs, output):
    q, k, v, ctx.kv_heads, ctx.g, ctx.causal, ctx.p, ctx.scale, *window = inputs
    ctx.window = window[0] if window else 0
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _flash_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    extra = (ctx.window,) if ctx.window else ()  # a windowless graph traces as it did before windows
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.kv_heads, ctx.g, ctx.causal, ctx.p, ctx.scale,
                                          *extra)
    return dq, dk, dv, None, None, None, None, None, None


flash_attention.register_autograd(_flash_backward, setup_context=_flash_setup_context)


def _wide(*xs):
    """The reference kernels compute in float32 at least, as the real ones accumulate."""
    dtype = torch.promote_types(xs[0].dtype, torch.float32)
    return tuple(x.to(dtype) for x in xs)


def _scores(q, k, scale: float, causal: bool, s: int, g: int, window: int = 0) -> torch.Tensor:
    """Q K^T * scale, the future (and keys beyond the window) masked; rows are (position, head in group)."""
    scores = torch.bmm(q, k.transpose(1, 2)) * scale
    if causal:
        hidden = attention_mask(s, window, q.device).repeat_interleave(g, dim=0)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def attention_mask(s: int, window: int, device) -> torch.Tensor:
    """[s, s] True where query i may not see key j: the future, and with a sliding window of w the
    keys w or more positions back (Beltagy et al. 2020; Mistral's window, Jiang et al. 2023)."""
    ones = torch.ones(s, s, dtype=torch.bool, device=device)
    future = ones.triu(1)
    return future | ones.tril(-window) if 0 < window < s else future


def _to_sbhd(x, b, kv, s, g, d):
    return x.view(b, kv, s, g, d).permute(2, 0, 1, 3, 4).contiguous()


def _core_attention(module, q, k, v, s: int, b: int, kv: int, g: int):
    """softmax(Q K^T / sqrt(d)) V on the local heads: q [b kv, s g, d], k [b kv, s, d], v [b kv, s, dv];
    the context in Megatron's layout [s, b, kv g dv], ready for the output projection."""
    d, dv = q.shape[-1], v.shape[-1]
    if module.flash:
        extra = (module.window,) if module.window else ()
        out, _lse = flash_attention(q, k, v, kv, g, module.causal, module.p, 1.0 / math.sqrt(d), *extra)
        return out.view(s, b, kv * g * dv)
    scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))  # [b kv, s g, s]
    if module.causal:
        hidden = attention_mask(s, module.window, q.device)
        scores = scores.masked_fill(hidden.repeat_interleave(g, dim=0), float("-inf"))
    probs = dropout(torch.softmax(scores, dim=-1), module.p)
    ctx = torch.bmm(probs, v)  # [b kv, s g, dv]
    return ctx.view(b, kv, s, g, dv).permute(2, 0, 1, 3, 4).reshape(s, b, kv * g * dv)


def _from_sbhd(x):
    s, b, kv, g, d = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(b * kv, s * g, d)


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention on heads/t local heads.

    Grouped-query attention (Ainslie et al. 2023) is computed without copying K and V: the g query
    heads that share one KV head are stacked along the rows of one batched GEMM. When t exceeds the
    KV heads (multi-query attention, Shazeer 2019, at any t > 1) each device holds one copy of the
    KV head its query heads share (`ModelConfig.local_kv_heads`); the copies' weight gradients are
    summed once per step with the data-parallel ones, which this per-microbatch graph leaves out.
    `window` > 0: sliding-window attention; `qk_norm`: RMSNorm on each query and key head.
    """

    def __init__(self, model: ModelConfig, t: int, dtype, window: int = 0):
        super().__init__()
        self.t = t
        self.heads = _shard(model.heads, t, "heads")
        self.kv_heads = model.local_kv_heads(t)
        self.group = self.heads // self.kv_heads
        self.d = model.head_dim
        self.causal = model.causal
        self.rotary = model.position == "rotary"
        self.p = model.dropout
        self.flash = model.attention == "flash"
        self.window = window
        # t x the local width: with replicated KV heads each device holds a whole KV head
        width = (model.heads + 2 * self.kv_heads * t) * self.d
        if model.qkv_projection == "separate":  # ModelConfig.qkv_projection: three outputs of their own
            self.qkv = None
            kv_width = self.kv_heads * t * self.d
            self.q = ColumnParallelLinear(model.hidden, model.heads * self.d, t, model.bias, dtype, "Q width")
            self.k = ColumnParallelLinear(model.hidden, kv_width, t, model.bias, dtype, "KV width")
            self.v = ColumnParallelLinear(model.hidden, kv_width, t, model.bias, dtype, "KV width")
        else:
            self.qkv = ColumnParallelLinear(model.hidden, width, t, model.bias, dtype, "QKV width")
        self.proj = RowParallelLinear(model.heads * self.d, model.hidden, t, model.bias, dtype, "heads x head size")
        if model.qk_norm:  # Dehghani et al. 2023; Qwen3 normalises before the rotary embedding
            self.q_norm = RMSNorm(self.d, model.norm_eps, dtype)
            self.k_norm = RMSNorm(self.d, model.norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x):
        s, b, _ = x.shape
        kv, g, d = self.kv_heads, self.group, self.d
        if self.qkv is None:  # query head i reads KV head i // g, as in the fused layout
            q, k, v = self.q(x).view(s, b, kv, g * d), self.k(x).view(s, b, kv, d), self.v(x).view(s, b, kv, d)
        else:  # Megatron's layout: per KV group, g query heads then its key and value: [s, b, kv, (g + 2) d]
            qkv = self.qkv(x).view(s, b, kv, (g + 2) * d)
            q, k, v = torch.split(qkv, [g * d, d, d], dim=-1)
        q = q.reshape(s, b, kv, g, d).permute(1, 2, 0, 3, 4)  # [b, kv, s, g, d]
        k = k.permute(1, 2, 0, 3)  # [b, kv, s, d]
        v = v.permute(1, 2, 0, 3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            cos, sin = _rotary_tables(s, d, x.dtype, x.device)
            q = q * cos[:, None, :] + _rotate_half(q) * sin[:, None, :]
            k = k * cos + _rotate_half(k) * sin
        q = q.reshape(b * kv, s * g, d)  # query rows ordered (position, head in group)
        k = k.reshape(b * kv, s, d)
        v = v.reshape(b * kv, s, d)
        return self.proj(_core_attention(self, q, k, v, s, b, kv, g))


class RecomputeScope(nn.Module):
    """A stretch of its owner's forward (`fn`, run on `args`) that a module-level recompute reruns,
    as a parameter-less module so that the tracer can tag what it makes (trace.py)."""

    def __init__(self, recompute_module: str):
        super().__init__()
        self.recompute_module = recompute_module

    def forward(self, fn, *args):
        return fn(*args)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, Sec. 2.1, eq. 9-19;
    DeepSeek-V3, arXiv:2412.19437, Sec. 2.1.1), trained as Megatron-Core's MLASelfAttention shards it:

    - queries: c_Q = RMSNorm(h W_DQ) (rank q_lora_rank), then q = c_Q W_UQ per head, split into
      qk_nope_head_dim content dims and qk_rope_head_dim rotary dims (no bottleneck: q = h W_Q);
    - keys/values: [c_KV; k_R] = h W_DKV, c_KV = RMSNorm(c_KV) (rank kv_lora_rank), per head
      [k_C; v] = c_KV W_UKV; the rotary key k_R (qk_rope_head_dim) is one, shared by all heads;
    - attention per head on [q_C; RoPE(q_R)] . [k_C; RoPE(k_R)] / sqrt(nope + rope), then v;
    - TP: the down-projections W_DQ, W_DKV replicated on every device, the up-projections W_UQ,
      W_UKV column-parallel (heads / t each), the output projection row-parallel. Megatron's `f`
      (the backward all-reduce) sits on the latents the local heads read (c_Q, c_KV, k_R), so the
      down-projections' weight and input gradients are whole on every device.
    """

    def __init__(self, model: ModelConfig, t: int, dtype, window: int = 0):
        super().__init__()
        self.t = t
        self.heads = _shard(model.heads, t, "heads")
        self.nope, self.rope, self.dv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        self.causal, self.p, self.window = model.causal, model.dropout, window
        self.flash = model.attention == "flash"
        qk = model.heads * (self.nope + self.rope)
        if model.q_lora_rank:
            self.q_down = ReplicatedLinear(model.hidden, model.q_lora_rank, dtype)
            self.q_norm = RMSNorm(model.q_lora_rank, model.norm_eps, dtype)
            self.q_up = ColumnParallelLinear(model.q_lora_rank, qk, t, model.bias, dtype, "heads")
            self.q_proj = None
        else:
            self.q_down = self.q_norm = self.q_up = None
            self.q_proj = ColumnParallelLinear(model.hidden, qk, t, model.bias, dtype, "heads")
        self.kv_lora = model.kv_lora_rank
        self.kv_down = ReplicatedLinear(model.hidden, model.kv_lora_rank + self.rope, dtype)
        self.kv_norm = RMSNorm(model.kv_lora_rank, model.norm_eps, dtype)
        self.kv_up = ColumnParallelLinear(model.kv_lora_rank, model.heads * (self.nope + self.dv), t, model.bias,
                                          dtype, "heads")
        self.proj = RowParallelLinear(model.heads * self.dv, model.hidden, t, model.bias, dtype, "heads")
        self.up_projection = RecomputeScope("mla_up_proj")

    def forward(self, x):
        s, b, _ = x.shape
        t, H = self.t, self.heads
        q_latent = copy_to_tp(x if self.q_proj is not None else self.q_norm(self.q_down(x)), t)
        latent, k_r = torch.split(self.kv_down(x), [self.kv_lora, self.rope], dim=-1)
        q, k, v = self.up_projection(self._up_project, q_latent, copy_to_tp(self.kv_norm(latent), t), copy_to_tp(k_r, t))
        return self.proj(_core_attention(self, q, k, v, s, b, H, 1))

    def _up_project(self, q_latent, kv_latent, k_r):
        """The up-projections and RoPE: the latents (and the rotary key) to the heads' Q, K and V in
        the core attention's layout; what Megatron-Core's `mla_up_proj` recompute reruns
        (MLASelfAttention `qkv_up_proj_and_rope_apply`)."""
        s, b, _ = q_latent.shape
        H, nope, rope, dv = self.heads, self.nope, self.rope, self.dv
        q = (self.q_proj if self.q_proj is not None else self.q_up)(q_latent)
        q_c, q_r = torch.split(q.view(s, b, H, nope + rope), [nope, rope], dim=-1)
        kv = self.kv_up(kv_latent).view(s, b, H, nope + dv)
        k_c, v = torch.split(kv, [nope, dv], dim=-1)
        cos, sin = _rotary_tables(s, rope, q.dtype, q.device)
        q_r = q_r * cos[:, None, None, :] + _rotate_half(q_r) * sin[:, None, None, :]
        k_r = k_r * cos[:, None, :] + _rotate_half(k_r) * sin[:, None, :]
        q = torch.cat((q_c, q_r), dim=-1)  # [s, b, H, nope + rope]
        k = torch.cat((k_c, k_r.unsqueeze(2).expand(s, b, H, rope)), dim=-1)
        d = nope + rope
        q = q.permute(1, 2, 0, 3).reshape(b * H, s, d)
        k = k.permute(1, 2, 0, 3).reshape(b * H, s, d)
        v = v.permute(1, 2, 0, 3).reshape(b * H, s, dv)
        return q, k, v


def make_attention(model: ModelConfig, t: int, dtype, window: int = 0) -> nn.Module:
    return (LatentAttention if model.mla else SelfAttention)(model, t, dtype, window)


def _activate(y, activation: str):
    if activation == "swiglu":  # Shazeer 2020, "GLU Variants Improve Transformer"
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(y)
    if activation == "squared_relu":  # So et al. 2021, "Primer"; Nemotron-4 (Parmar et al. 2024)
        return F.relu(y).square()
    return F.relu(y)


# Module-level recompute (Training.recompute_modules): the tracer tags every forward value with
# the `recompute_module` names of the modules whose forward produced it (trace.py, "Module-level
# recompute"). The names are Megatron-Core's (TransformerConfig.recompute_modules), except
# LAYERNORM_LINEAR: a norm whose output only a column-parallel linear reads, which Megatron-Core's
# Transformer Engine layer spec fuses into that linear (TELayerNormColumnParallelLinear: the
# input_layernorm / pre_mlp_layernorm slot is then IdentityOp, gpt_layer_specs.py), where
# `layernorm` recompute does not act (transformer_layer.py: only a norm that is not IdentityOp).
LAYERNORM = "layernorm"


class Activation(nn.Module):
    """The experts' activation function as a module of its own, so that the tracer can tell its
    output apart (`moe_act` recompute: Megatron-Core's GroupedMLP activation)."""

    recompute_module = "moe_act"

    def __init__(self, activation: str):
        super().__init__()
        self.activation = activation

    def forward(self, y, weights=None):
        """`weights` (one per row of y, or None): scale each row's output, inside the module as
        Megatron-Core's weighted activation does (so `moe_act` recompute reruns the product too)."""
        a = _activate(y, self.activation)
        return a if weights is None else a * weights.to(a.dtype).view(*y.shape[:-1], 1)


class MLP(nn.Module):
    def __init__(self, model: ModelConfig, t: int, dtype, ffn: int | None = None):
        super().__init__()
        self.activation = model.activation
        ffn = model.ffn if ffn is None else ffn
        width = 2 * ffn if model.activation == "swiglu" else ffn  # SwiGLU: gate and up
        self.fc1 = ColumnParallelLinear(model.hidden, width, t, model.bias, dtype, "ffn")
        self.fc2 = RowParallelLinear(ffn, model.hidden, t, model.bias, dtype, "ffn")

    def forward(self, x):
        return self.fc2(_activate(self.fc1(x), self.activation))


def expert_capacity(model: ModelConfig, tokens: int) -> int:
    """Token slots per expert: ceil(capacity factor x tokens x k / experts) (Fedus et al. 2022,
    "Switch Transformers", eq. 3, with k experts per token as in GShard, Lepikhin et al. 2021)."""
    return max(1, math.ceil(model.capacity_factor * tokens * model.top_k / model.experts))


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer on one device (expert parallelism 1), traced as it runs.

    - router: a replicated GEMM onto the experts' logits, softmax in float32, top-k
      (Shazeer et al. 2017; Mixtral renormalises the k gate weights, `gate_renorm`);
    - auxiliary load-balancing loss alpha E sum_i f_i P_i, f_i the fraction of routed slots that
      chose expert i and P_i its mean router probability (Fedus et al. 2022, Switch Transformer,
      eq. 4-6; f counts slots, not differentiable, as there);
    - dispatch: the T k (token, expert) slots sorted by expert and their tokens gathered into
      per-expert buffers of `expert_capacity` rows (Megatron-Core's token permutation; padding when
      the capacity factor exceeds 1, dropping when below);
    - the experts' GEMMs grouped: one batched GEMM over the E experts per linear (a grouped GEMM),
      each expert SwiGLU/GELU of width expert_ffn, sharded over the TP group like a dense MLP
      (column-parallel first linear, row-parallel second; expert tensor parallelism = TP);
    - combine: each slot's output scaled by its gate weight and added back to its token (index_add);
      with `weights_in_mlp` the gate weight scales the activation's output instead, before the
      second linear (Megatron-Core from 0.13, commit 2659630721 "Memory efficient token
      permutation", 2025-04: TEGroupedMLP's `weighted_bias_swiglu_impl` / `bias_act_func`), so the
      combine adds unscaled rows and the second linear's output is not kept for the weights'
      gradient (the fused weighted activation keeps its input and the weights; the same sum);
    - `shared_experts` always-on experts (DeepSeek-MoE) as one dense MLP of shared x expert_ffn.

    Under expert parallelism e the same tokens meet the same experts, E/e per device with e times
    the rows each: the FLOPs are those traced here; the all-to-alls around the experts are costed
    by the placement (solve/placement/expert.py).
    """

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t, self.E, self.k, self.model = t, model.experts, model.top_k, model
        self.activation, self.renorm, self.alpha = model.activation, model.gate_renorm, model.aux_loss_coef
        local = _shard(model.expert_ffn, t, "expert_ffn")
        width = 2 * local if model.activation == "swiglu" else local
        self.router = _param(dtype, model.experts, model.hidden)
        self.w1 = _param(dtype, model.experts, model.hidden, width)
        self.w2 = _param(dtype, model.experts, local, model.hidden)
        self.parallel = {"w1": "column", "w2": "row"}  # read by the tracer (trace.py)
        shared = model.shared_experts * model.expert_ffn
        self.shared = MLP(model, t, dtype, ffn=shared) if shared else None
        if self.shared is not None:
            self.shared.recompute_module = "shared_experts"
        self.act = Activation(model.activation)
        self.weights_in_mlp = False  # set by build_layer (EXPERT_WEIGHTS)

    def forward(self, x):
        s, b, h = x.shape
        T, E, k = s * b, self.E, self.k
        xf = x.reshape(T, h)
        probs = torch.softmax(F.linear(xf, self.router).float(), dim=-1)  # [T, E]
        gate, chosen = torch.topk(probs, k, dim=-1)  # [T, k]
        if self.renorm:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        counts = torch.zeros(E, dtype=torch.float32, device=x.device).scatter_add(
            0, flat, torch.ones(T * k, dtype=torch.float32, device=x.device))
        aux = self.alpha * E * (counts / (T * k) * probs.mean(dim=0)).sum()
        order = torch.argsort(flat)  # slots grouped by expert
        C = expert_capacity(self.model, T)
        kept = min(T * k, E * C)  # slots beyond the capacity are dropped
        order = order[:kept]
        token = torch.div(order, k, rounding_mode="floor")
        rows = xf.index_select(0, token)  # dispatch
        if kept < E * C:
            rows = F.pad(rows, (0, 0, 0, E * C - kept))
        weight = gate.reshape(-1).index_select(0, order)  # each kept slot's gate weight
        slots = None
        if self.weights_in_mlp:
            slots = F.pad(weight, (0, E * C - kept)) if kept < E * C else weight
        a = self.act(torch.bmm(rows.view(E, C, h), self.w1), slots)
        y = torch.bmm(a, self.w2).reshape(E * C, h)[:kept]
        if not self.weights_in_mlp:
            y = y * weight.to(y.dtype).unsqueeze(-1)
        out = torch.zeros(T, h, dtype=x.dtype, device=x.device).index_add(0, token, y)  # combine
        out = reduce_from_tp(out, self.t)
        if self.shared is not None:
            shared, bias = self.shared(x)
            out = out + (shared.reshape(T, h) if bias is None else (shared + bias).reshape(T, h))
        return out.view(s, b, h), aux


class TransformerBlock(nn.Module):
    """One transformer layer; pre-norm for GPT/OPT/Llama, post-norm for BERT.

    A parallel block (`ModelConfig.parallel_block`; GPT-J, PaLM Sec. 2) has one norm: attention and
    MLP read the same input, their row-parallel partial sums are added and all-reduced once (PaLM
    fuses the two input projections the same way), and x + attention + MLP is the output.
    """

    def __init__(self, model: ModelConfig, t: int, dtype, window: int = 0):
        super().__init__()
        self.t, self.p, self.post_norm = t, model.dropout, model.post_norm
        self.mla, self.parallel_block = model.mla, model.parallel_block
        self.norm1 = make_norm(model, dtype)
        self.attention = make_attention(model, t, dtype, window)
        self.norm2 = None if model.parallel_block else make_norm(model, dtype)
        self.mlp = MLP(model, t, dtype)
        if model.parallel_block:
            self.attention.proj.reduce = self.mlp.fc2.reduce = False
        self.mlp.recompute_module = "mlp"
        if not model.post_norm:  # pre-norm: each norm's output feeds its sublayer only
            self.norm1.recompute_module = LAYERNORM if model.mla or model.parallel_block else LAYERNORM_LINEAR
            if self.norm2 is not None:
                self.norm2.recompute_module = LAYERNORM_LINEAR

    def _attend(self, h):
        """Attention on the normalised input; MLA places Megatron's `f` on its latents itself."""
        return self.attention(h) if self.mla else self.attention(copy_to_tp(h, self.t))

    def _residual(self, x, out):
        y, bias = out
        if bias is not None:
            y = y + bias
        return x + dropout(y, self.p)

    def forward(self, x):
        t = self.t
        if self.post_norm:
            x = self.norm1(self._residual(x, self.attention(copy_to_tp(x, t))))
            return self.norm2(self._residual(x, self.mlp(copy_to_tp(x, t))))
        if self.parallel_block:
            h = copy_to_tp(self.norm1(x), t)
            (a, a_bias), (m, m_bias) = self.attention(h), self.mlp(h)
            y = reduce_from_tp(a + m, t)
            biases = [bias for bias in (a_bias, m_bias) if bias is not None]
            return self._residual(x, (y, sum(biases[1:], biases[0]) if biases else None))
        x = self._residual(x, self._attend(self.norm1(x)))
        return self._residual(x, self.mlp(copy_to_tp(self.norm2(x), t)))


class MoEBlock(TransformerBlock):
    """A pre-norm block whose MLP is a mixture of experts; it also returns the load-balancing loss
    (a second output, so the traced backward includes the router's gradient through it)."""

    def __init__(self, model: ModelConfig, t: int, dtype, window: int = 0):
        super().__init__(model, t, dtype, window)
        self.mlp = MoE(model, t, dtype)
        self.mlp.recompute_module = "moe"
        self.norm2.recompute_module = LAYERNORM  # read by the router and the experts: not fused

    def forward(self, x):
        t = self.t
        x = self._residual(x, self._attend(self.norm1(x)))
        y, aux = self.mlp(copy_to_tp(self.norm2(x), t))
        return self._residual(x, (y, None)), aux


class MultiTokenPrediction(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3, arXiv:2412.19437, Sec. 2.2, eq. 21-25): the
    main model's last hidden state h and the embedding of the next token, each RMS-normalised,
    concatenated and projected (M_k, 2h -> h), one transformer block, then the shared output head
    and its cross-entropy loss (weighted by lambda, a constant). It passes h on unchanged to the
    main model's head.

    The embedding table and the output projection are the main model's (`tied_parameters`: counted
    once in the model's size, but held here as well, as the last pipeline stage holds them in
    DeepSeek-V3's training). The projection M_k is replicated over the TP group (our choice; one
    GEMM of 2h x h per token, 1.5% of a DeepSeek-V3 block's FLOPs).
    """

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t, self.rows = t, vocab_rows(model, t)
        self.word = _param(dtype, self.rows, model.hidden)
        self.hidden_norm = make_norm(model, dtype)
        self.embedding_norm = make_norm(model, dtype)
        self.proj = ReplicatedLinear(2 * model.hidden, model.hidden, dtype)
        self.block = MoEBlock(model, t, dtype) if model.moe else TransformerBlock(model, t, dtype)
        self.head = Head(model, t, dtype)
        self.head.tied_parameters = ()
        self.tied_parameters = ("word", "head.weight")

    def forward(self, x, ids):
        if self.t > 1:
            outside = ids >= self.rows  # as Embedding.forward (rank 0's view)
            e = F.embedding(ids.masked_fill(outside, 0), self.word)
            e = reduce_from_tp(e.masked_fill(outside.unsqueeze(-1), 0.0), self.t)
        else:
            e = F.embedding(ids, self.word)
        h = self.proj(torch.cat((self.hidden_norm(x), self.embedding_norm(e)), dim=-1))
        out = self.block(h)
        h, aux = out if isinstance(out, tuple) else (out, None)
        loss = self.head(h, ids)
        return (x, loss) if aux is None else (x, loss, aux)


class Embedding(nn.Module):
    """Word (vocabulary-parallel), learned position and token-type embeddings; BERT adds a norm."""

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t, self.p, self.rows = t, model.dropout, vocab_rows(model, t)
        self.word = _param(dtype, self.rows, model.hidden)
        self.position = _param(dtype, model.positions, model.hidden) if model.position == "learned" else None
        self.token_type = _param(dtype, model.type_vocab, model.hidden) if model.type_vocab else None
        self.norm = make_norm(model, dtype) if model.family == "bert" else None

    def forward(self, ids, token_types=None):
        if self.t > 1:
            outside = ids >= self.rows  # tokens another device of the group holds (rank 0's view)
            x = F.embedding(ids.masked_fill(outside, 0), self.word)
            x = reduce_from_tp(x.masked_fill(outside.unsqueeze(-1), 0.0), self.t)
        else:
            x = F.embedding(ids, self.word)
        if self.position is not None:
            positions = torch.arange(ids.shape[0], device=ids.device)
            x = x + F.embedding(positions, self.position).unsqueeze(1)
        if self.token_type is not None:
            x = x + F.embedding(token_types, self.token_type)
        if self.norm is not None:
            x = self.norm(x)
        return dropout(x, self.p)


class Head(nn.Module):
    """Final norm (BERT: the masked-LM transform), projection onto the vocabulary, and the loss.

    With tied embeddings the projection is the word-embedding matrix; the last pipeline stage keeps
    its own copy of it (Megatron all-reduces the two copies' gradients), so it is a parameter of this
    module too, and `tied_parameters` names it so the model total can count it once.
    """

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t, self.rows, self.bert = t, vocab_rows(model, t), model.family == "bert"
        if self.bert:  # BERT's masked-LM transform: dense + GELU + LayerNorm, replicated (Devlin et al. 2019)
            self.transform = nn.Module()
            self.transform.weight = _param(dtype, model.hidden, model.hidden)
            self.transform.bias = _param(dtype, model.hidden)
        self.norm = make_norm(model, dtype)
        self.weight = _param(dtype, self.rows, model.hidden)
        self.bias = _param(dtype, self.rows) if self.bert else None  # BERT's decoder bias
        self.tied_parameters = ("weight",) if model.tied_embeddings else ()
        self.parallel = {"weight": "column"}  # read by the tracer: the vocabulary-parallel projection

    def forward(self, x, labels):
        if self.bert:
            x = F.gelu(F.linear(x, self.transform.weight, self.transform.bias))
        logits = F.linear(copy_to_tp(self.norm(x), self.t), self.weight, self.bias)
        return vocab_parallel_cross_entropy(logits, labels, self.t, self.rows)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Token cross-entropy over logits split by vocabulary, Megatron's way (Shoeybi et al. 2019).

    A custom autograd function as in Megatron: the forward keeps only the softmax (float32, the
    size of the local logits) and the targets, and the backward is softmax minus the one-hot target
    on the local slice (subtracted in place at one logit per token), with no communication. Each rank only holds the target logit of tokens in
    its slice, hence the masked pick and its all-reduce. The max is a constant shift for stability.
    """

    @staticmethod
    def forward(ctx, logits, labels, t: int, rows: int):
        shift = reduce_from_tp(logits.amax(dim=-1, keepdim=True), t, "max")
        z = logits - shift
        if t > 1:
            outside = labels >= rows  # targets another device of the group holds (rank 0's view)
            target = labels.masked_fill(outside, 0)
        else:
            outside, target = None, labels
        picked = torch.gather(z, -1, target.unsqueeze(-1)).squeeze(-1)
        if t > 1:
            picked = reduce_from_tp(picked.masked_fill(outside, 0.0), t)
        exp = torch.exp(z)
        total = reduce_from_tp(exp.sum(dim=-1), t)
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, target, outside if outside is not None else target)
        ctx.has_outside = outside is not None
        return torch.log(total) - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, target, outside = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        grad_logits = softmax * g
        minus_hit = -g if not ctx.has_outside else -(g * (~outside).unsqueeze(-1).to(g.dtype))
        grad_logits.scatter_add_(-1, target.unsqueeze(-1), minus_hit)  # touches one logit per token
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits, labels, t: int, rows: int):
    """Mean token cross-entropy of [s, b, rows] logits (float32, as Megatron computes it)."""
    return _VocabParallelCrossEntropy.apply(logits.float(), labels, t, rows).mean()


def build_layer(model: ModelConfig, kind: str, t: int, expert_weights: str = EXPERT_WEIGHTS[0]) -> nn.Module:
    """The module of one layer kind at TP width t, on the meta device."""
    if expert_weights not in EXPERT_WEIGHTS:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    module = _build_layer(model, kind, t)
    for m in module.modules():
        if isinstance(m, MoE):
            m.weights_in_mlp = expert_weights == "activation"
    return module


def _build_layer(model: ModelConfig, kind: str, t: int) -> nn.Module:
    dtype = TORCH_DTYPES[model.dtype]
    if kind == "embedding":
        return Embedding(model, t, dtype)
    if kind in BLOCK_KINDS:
        window = model.window if kind.startswith("local_") else 0
        cls = MoEBlock if routed_kind(model, kind) else TransformerBlock
        return cls(model, t, dtype, window)
    if kind == "mtp":
        return MultiTokenPrediction(model, t, dtype)
    if kind == "head":
        return Head(model, t, dtype)
    raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")


def example_inputs(model: ModelConfig, kind: str, mbs: int, seq: int) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the layer kind's inputs for one microbatch of `mbs` sequences."""
    ids = torch.empty(seq, mbs, dtype=torch.int64, device=META)
    hidden = torch.empty(seq, mbs, model.hidden, dtype=TORCH_DTYPES[model.dtype], device=META)
    if kind == "embedding":
        return (ids, torch.empty_like(ids)) if model.type_vocab else (ids,)
    if kind in BLOCK_KINDS:
        return (hidden,)
    if kind in ("head", "mtp"):
        return (hidden, ids)
    raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")
