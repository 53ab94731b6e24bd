"""The FLOPs a drafter's training step counts: the (query, key) pairs its BlockMask lets attend, and the model
FLOPs of a step by the kernels that run them. MFU (dflash.train.metrics) and the step-time model
(dflash.drafter.step_time) both count with them; the formula is in docs/training.md.
"""

import torch

from dflash.drafter.model import DrafterConfig


def visible_pairs(anchors, valid, doc_ids, block_size, window: int | None = None) -> torch.Tensor:
    """(query, key) pairs the BlockMask lets attend, over valid blocks: each of a block's B queries sees the
    context of its document before the anchor (with a window, the query at slot k at most window - 1 - k of it)
    and the B tokens of its block (documents are contiguous runs)."""
    T = doc_ids.shape[1]
    position = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, position, 0).cummax(dim=1).values
    context = anchors - doc_start.gather(1, anchors)
    return (block_pairs(context, block_size, window) * valid).sum()


def block_pairs(context: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor:
    """The pairs one block lets attend, per block whose anchor has `context` tokens of its document before it: each
    of its B queries sees that context (with a window, the query at slot k at most window - 1 - k of it) and the
    B tokens of the block."""
    if window is None:
        seen = block_size * context
    else:
        reach = (window - 1 - torch.arange(block_size, device=context.device)).clamp(min=0)
        seen = torch.minimum(context[..., None], reach).sum(-1)
    return seen + block_size * block_size


# Model FLOPs of the counted work, with context tokens C (non-padding), drafted block tokens D, labelled positions
# L (positive loss weight) and visible attention pairs P; hidden H, FFN F, h query / g KV heads of dim d, n drafter
# layers, f tapped target layers, vocabulary V:
#
#   trainable forward = n * [D * 2 * (H*h*d + h*d*H + 3*H*F + 2*H*g*d)    q, o, gate / up / down, k / v of blocks
#                            + C * 2 * (2*H*g*d)]                         k / v of the context (KV injection)
#                       + C * 2 * W*H                                     fc fusion (W = f*H)
#                       + D * E                                           a method's own matmuls per block token
#                                                   (DrafterConfig.method_flops_per_token; DFlash 2: its conv
#                                                   projections, the selector's projection, candidates and edges)
#   LM head forward   = L * 2 * V * H
#   lift forward      = C * 2 * k * W                                     a subspace store's P h back to P^T P h
#   teacher forward   = T * 2 * V * H                                     the target's LM head on its stored final
#                                                   hidden state (DSpark's `--teacher hidden`: T = L; else 0)
#   attention forward = n * 4 * P * h * d                                 QK^T and PV
#   FLOPs = 3 * trainable forward + 2 * LM head forward + lift forward + teacher forward + 3.5 * attention forward
#
# Trainable matmuls count 3x (forward, input gradient, weight gradient); the frozen LM head 2x (its weight gradient
# is never computed); the frozen lift and teacher head 1x (nothing before them needs a gradient); attention 3.5x
# its forward (backward 2.5 with the recomputation of the scores). k (`lifted_width`) is 0 without a subspace.
def step_flops(*args, **kwargs) -> float:
    """The counted FLOPs of a step: step_flops_by_kind's, summed."""
    return sum(step_flops_by_kind(*args, **kwargs).values())


def step_flops_by_kind(
    dcfg: DrafterConfig,
    context_tokens: float,
    drafted: float,
    labelled: float,
    pairs: float,
    lifted_width: int = 0,
    teacher_rows: float = 0,
) -> dict[str, float]:
    """step_flops split by the kernels that run them: {"matmul": the projections, MLPs, fc, a method's own
    matmuls, the LM heads and the lift; "attention": QK^T and PV, forward and backward}."""
    H, F_, hd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim
    q_width, kv_width = dcfg.num_attention_heads * hd, dcfg.num_key_value_heads * hd
    per_layer_block = 2 * (H * q_width + q_width * H + 3 * H * F_ + 2 * H * kv_width)  # per block token
    per_layer_context = 2 * (2 * H * kv_width)  # k / v projections of the context
    trainable = dcfg.num_layers * (per_layer_block * drafted + per_layer_context * context_tokens)
    trainable += 2 * dcfg.feature_dim * H * context_tokens  # fc
    trainable += dcfg.method_flops_per_token() * drafted
    head = 2 * dcfg.vocab_size * H * labelled
    lift = 2 * lifted_width * dcfg.feature_dim * context_tokens
    teacher = 2 * dcfg.vocab_size * H * teacher_rows
    attention = dcfg.num_layers * 4 * pairs * dcfg.num_attention_heads * hd
    return {"matmul": 3 * trainable + 2 * head + lift + teacher, "attention": 3.5 * attention}
