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
from .models import ModelConfig

META = torch.device("meta")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KINDS = ("embedding", "dense_block", "block", "head")  # dense_block: the dense first blocks of a MoE model


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
    dropout and the residual add)."""

    parallel = "row"  # read by the tracer: the output leaves Megatron's tensor-parallel region

    def __init__(self, n_in: int, n_out: int, t: int, bias: bool, dtype, what: str):
        super().__init__()
        self.t = t
        self.weight = _param(dtype, n_out, _shard(n_in, t, what))
        self.bias = _param(dtype, n_out) if bias else None

    def forward(self, x):
        return reduce_from_tp(F.linear(x, self.weight), self.t), self.bias


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


@torch.library.custom_op("phaze::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, g: int, causal: bool,
                    p: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [s, b, kv_heads, g, d], log-sum-exp [B, s*g] float32) of exact attention."""
    b, s, d = _flash_rows(q, kv_heads, g)
    qf, kf, vf = _wide(q, k, v)
    scores = _scores(qf, kf, scale, causal, s, g)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.bmm(torch.exp(scores - lse[..., None]), vf)
    return _to_sbhd(out.to(q.dtype), b, kv_heads, s, g, d), lse.float()


@flash_attention.register_fake
def _flash_attention_fake(q, k, v, kv_heads, g, causal, p, scale):
    b, s, d = _flash_rows(q, kv_heads, g)
    return q.new_empty(s, b, kv_heads, g, d), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


@torch.library.custom_op("phaze::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, kv_heads: int, g: int, causal: bool, p: float,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV): the scores recomputed from Q, K and L; dS = P * (dP - rowsum(dO * O))."""
    b, s, d = _flash_rows(q, kv_heads, g)
    qf, kf, vf, do, o = _wide(q, k, v, _from_sbhd(dout), _from_sbhd(out))
    scores = _scores(qf, kf, scale, causal, s, g)
    probs = torch.exp(scores - lse[..., None].to(scores.dtype))
    dv = torch.bmm(probs.transpose(1, 2), do)
    dp = torch.bmm(do, vf.transpose(1, 2))
    ds = probs * (dp - (do * o).sum(-1, keepdim=True)) * scale
    return torch.bmm(ds, kf).to(q.dtype), torch.bmm(ds.transpose(1, 2), qf).to(k.dtype), dv.to(v.dtype)


@flash_attention_backward.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, kv_heads, g, causal, p, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup_context(ctx, inputs, output):
    q, k, v, ctx.kv_heads, ctx.g, ctx.causal, ctx.p, ctx.scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _flash_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, ctx.kv_heads, ctx.g, ctx.causal, ctx.p, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


flash_attention.register_autograd(_flash_backward, setup_context=_flash_setup_context)


def _wide(*xs):
    """The reference kernels compute in float32 at least, as the real ones accumulate."""
    dtype = torch.promote_types(xs[0].dtype, torch.float32)
    return tuple(x.to(dtype) for x in xs)


def _scores(q, k, scale: float, causal: bool, s: int, g: int) -> torch.Tensor:
    """Q K^T * scale, the future masked for causal models; rows are (position, head in group)."""
    scores = torch.bmm(q, k.transpose(1, 2)) * scale
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1).repeat_interleave(g, dim=0)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _to_sbhd(x, b, kv, s, g, d):
    return x.view(b, kv, s, g, d).permute(2, 0, 1, 3, 4).contiguous()


def _from_sbhd(x):
    s, b, kv, g, d = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(b * kv, s * g, d)


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention on heads/t local heads.

    Grouped-query attention (Ainslie et al. 2023) is computed without copying K and V: the g query
    heads that share one KV head are stacked along the rows of one batched GEMM.
    """

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t = t
        self.heads = _shard(model.heads, t, "heads")
        self.kv_heads = _shard(model.kv_heads, t, "kv_heads")
        self.group = self.heads // self.kv_heads
        self.d = model.head_dim
        self.causal = model.causal
        self.rotary = model.position == "rotary"
        self.p = model.dropout
        self.flash = model.attention == "flash"
        width = (model.heads + 2 * model.kv_heads) * self.d
        self.qkv = ColumnParallelLinear(model.hidden, width, t, model.bias, dtype, "QKV width")
        self.proj = RowParallelLinear(model.heads * self.d, model.hidden, t, model.bias, dtype, "heads x head size")

    def forward(self, x):
        s, b, _ = x.shape
        kv, g, d = self.kv_heads, self.group, self.d
        # Megatron's layout: per KV group, g query heads then its key and value: [s, b, kv, (g + 2) d].
        qkv = self.qkv(x).view(s, b, kv, (g + 2) * d)
        q, k, v = torch.split(qkv, [g * d, d, d], dim=-1)
        q = q.reshape(s, b, kv, g, d).permute(1, 2, 0, 3, 4)  # [b, kv, s, g, d]
        k = k.permute(1, 2, 0, 3)  # [b, kv, s, d]
        v = v.permute(1, 2, 0, 3)
        if self.rotary:
            cos, sin = _rotary_tables(s, d, x.dtype, x.device)
            q = q * cos[:, None, :] + _rotate_half(q) * sin[:, None, :]
            k = k * cos + _rotate_half(k) * sin
        q = q.reshape(b * kv, s * g, d)  # query rows ordered (position, head in group)
        k = k.reshape(b * kv, s, d)
        v = v.reshape(b * kv, s, d)
        if self.flash:
            out, _lse = flash_attention(q, k, v, kv, g, self.causal, self.p, 1.0 / math.sqrt(d))
            return self.proj(out.view(s, b, kv * g * d))
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))  # [b kv, s g, s]
        if self.causal:
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future.repeat_interleave(g, dim=0), float("-inf"))
        probs = dropout(torch.softmax(scores, dim=-1), self.p)
        ctx = torch.bmm(probs, v)  # [b kv, s g, d]
        ctx = ctx.view(b, kv, s, g, d).permute(2, 0, 1, 3, 4).reshape(s, b, kv * g * d)
        return self.proj(ctx)


def _activate(y, activation: str):
    if activation == "swiglu":  # Shazeer 2020, "GLU Variants Improve Transformer"
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(y)
    return F.relu(y)


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
    - `shared_experts` always-on experts (DeepSeek-MoE) as one dense MLP of shared x expert_ffn.

    Under expert parallelism e the same tokens meet the same experts, E/e per device with e times
    the rows each: the FLOPs are those traced here; the all-to-alls around the experts are costed
    by the placement (solve/expert_parallel.py).
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
        y = torch.bmm(rows.view(E, C, h), self.w1)
        y = torch.bmm(_activate(y, self.activation), self.w2).reshape(E * C, h)[:kept]
        y = y * gate.reshape(-1).index_select(0, order).to(y.dtype).unsqueeze(-1)
        out = torch.zeros(T, h, dtype=x.dtype, device=x.device).index_add(0, token, y)  # combine
        out = reduce_from_tp(out, self.t)
        if self.shared is not None:
            shared, bias = self.shared(x)
            out = out + (shared.reshape(T, h) if bias is None else (shared + bias).reshape(T, h))
        return out.view(s, b, h), aux


class TransformerBlock(nn.Module):
    """One transformer layer; pre-norm for GPT/OPT/Llama, post-norm for BERT."""

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__()
        self.t, self.p, self.post_norm = t, model.dropout, model.post_norm
        self.norm1 = make_norm(model, dtype)
        self.attention = SelfAttention(model, t, dtype)
        self.norm2 = make_norm(model, dtype)
        self.mlp = MLP(model, t, dtype)

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
        x = self._residual(x, self.attention(copy_to_tp(self.norm1(x), t)))
        return self._residual(x, self.mlp(copy_to_tp(self.norm2(x), t)))


class MoEBlock(TransformerBlock):
    """A pre-norm block whose MLP is a mixture of experts; it also returns the load-balancing loss
    (a second output, so the traced backward includes the router's gradient through it)."""

    def __init__(self, model: ModelConfig, t: int, dtype):
        super().__init__(model, t, dtype)
        self.mlp = MoE(model, t, dtype)

    def forward(self, x):
        t = self.t
        x = self._residual(x, self.attention(copy_to_tp(self.norm1(x), t)))
        y, aux = self.mlp(copy_to_tp(self.norm2(x), t))
        return self._residual(x, (y, None)), aux


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


def layer_kinds(model: ModelConfig) -> tuple[str, ...]:
    """The layer kinds a model has, in order (a dense model has no `dense_block`)."""
    return ("embedding", "dense_block", "block", "head") if model.moe and model.dense_layers else ("embedding", "block", "head")


def layer_sequence(model: ModelConfig) -> list[tuple[str, str]]:
    """(name, kind) of every layer in order: embedding, the blocks, head."""
    dense = model.dense_layers if model.moe else 0
    return ([("embedding", "embedding")]
            + [(f"block.{i}", "dense_block" if i < dense else "block") for i in range(model.layers)]
            + [("head", "head")])


def build_layer(model: ModelConfig, kind: str, t: int) -> nn.Module:
    """The module of one layer kind at TP width t, on the meta device."""
    dtype = TORCH_DTYPES[model.dtype]
    if kind == "embedding":
        return Embedding(model, t, dtype)
    if kind == "block":
        return MoEBlock(model, t, dtype) if model.moe else TransformerBlock(model, t, dtype)
    if kind == "dense_block":
        return TransformerBlock(model, t, dtype)
    if kind == "head":
        return Head(model, t, dtype)
    raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")


def example_inputs(model: ModelConfig, kind: str, mbs: int, seq: int) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the layer kind's inputs for one microbatch of `mbs` sequences."""
    ids = torch.empty(seq, mbs, dtype=torch.int64, device=META)
    hidden = torch.empty(seq, mbs, model.hidden, dtype=TORCH_DTYPES[model.dtype], device=META)
    if kind == "embedding":
        return (ids, torch.empty_like(ids)) if model.type_vocab else (ids,)
    if kind in ("block", "dense_block"):
        return (hidden,)
    if kind == "head":
        return (hidden, ids)
    raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")
