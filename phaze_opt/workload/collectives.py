"""Megatron's tensor-parallel communication as traceable PyTorch operators.

Megatron-LM (Shoeybi et al. 2019, Sec. 3, Fig. 3) shards a transformer layer over t devices with two
conjugate operators around every column-parallel/row-parallel pair of linears:

- `f` (`copy_to_tp`): identity in forward, all-reduce of the input gradient in backward;
- `g` (`reduce_from_tp`): all-reduce of the partial outputs in forward, identity in backward.

The all-reduce is a registered custom operator (`phaze::allreduce`) so that it survives tracing as one
node that the workload mapper turns into a collective op. On the meta device it only produces a
tensor of the right shape. At t = 1 both operators are the identity and no collective is traced.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("phaze::allreduce", mutates_args=())
def allreduce(x: torch.Tensor, group: int, reduce: str) -> torch.Tensor:
    """All-reduce over the `group` devices of a TP group (sum or max); shape-only on meta."""
    return x.clone()


@allreduce.register_fake
def _allreduce_fake(x, group, reduce):
    return torch.empty_like(x)


def _allreduce_backward(ctx, grad):
    # The forward all-reduce leaves the same value on every rank, so each rank's gradient with
    # respect to its partial input is the incoming gradient itself: Megatron's `g` backward.
    return grad, None, None


allreduce.register_autograd(_allreduce_backward)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce(grad, ctx.group, "sum"), None


def copy_to_tp(x: torch.Tensor, t: int) -> torch.Tensor:
    """Megatron's `f`: the input of a column-parallel linear; its gradient is summed over the group."""
    return x if t == 1 else _CopyToTP.apply(x, t)


def reduce_from_tp(x: torch.Tensor, t: int, reduce: str = "sum") -> torch.Tensor:
    """Megatron's `g`: sums the partial outputs of a row-parallel linear (or a sharded reduction)."""
    return x if t == 1 else allreduce(x, t, reduce)
