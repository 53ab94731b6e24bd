"""The block cross-entropy through the target's frozen LM head, and the block acceptance metrics.

Memory is the point: [N x V] logits (32 K drafted tokens x 248 K vocabulary = 16 GB in bf16) must never exist at
once, and no chunk's logits may stay alive for the backward pass. Each position's CE depends on its own logits
only, so its gradient with respect to its hidden row is known as soon as a chunk's logits are: the forward pass
computes it chunk by chunk and keeps only that [N x H] gradient; backward scales each row by its CE's weight,
whatever weighting the caller applied (the paper's decay, or D-PACE's, which is computed from the CEs). That is two
LM-head matmuls per chunk (logits, input gradient), never the weight gradient of the frozen head, and no
recomputation of the logits.
"""

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dflash.topk import vocab_reductions


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for hidden's device (bf16 on GPU), else hidden's own dtype."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, labels, chunk_size, mm_dtype, need_grad, top_k):
        head = head.to(mm_dtype)  # a no-op when the caller keeps the frozen head in the matmul dtype
        math_dtype = torch.promote_types(mm_dtype, torch.float32)  # softmax math in fp32 (fp64 stays fp64)
        vocab = torch.arange(head.shape[0], device=hidden.device)
        losses, corrects, candidates, grads = [], [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows].to(mm_dtype) @ head.T
            label = labels[rows, None]
            # Each use upcasts on its own, so that compiled, no fp32 copy of the logits is ever written.
            if top_k:  # one pass over the logits for all three (vocab_reductions)
                lse, argmax, _, top = vocab_reductions(logits, top_k, math_dtype)
                candidates.append(top)
            else:
                lse, argmax = logits.to(math_dtype).logsumexp(dim=-1), logits.argmax(dim=-1)
            losses.append(lse - logits.gather(1, label)[:, 0].to(math_dtype))
            corrects.append(argmax == labels[rows])
            if need_grad:
                # dCE_i/d logits = softmax_i - onehot_i, then through the head to hidden; backward scales each row
                # by its CE's upstream gradient, so any weighting of the CEs (even one computed from them) is exact.
                # One pointwise expression (no scatter): compiled, one kernel writing mm_dtype directly.
                softmax = (logits.to(math_dtype) - lse[:, None]).exp()
                grad_logits = softmax - (vocab == label).to(math_dtype)
                grads.append((grad_logits.to(mm_dtype) @ head).to(hidden.dtype))
        ce, correct = torch.cat(losses), torch.cat(corrects)
        top = torch.cat(candidates) if top_k else labels.new_empty(labels.shape[0], 0)
        ctx.mark_non_differentiable(correct, top)
        if need_grad:
            ctx.save_for_backward(torch.cat(grads))
        return ce, correct, top

    @staticmethod
    def backward(ctx, grad_ce, grad_correct, grad_top):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_ce[:, None].to(grad_hidden.dtype), None, None, None, None, None, None


def default_chunk_size(vocab_size: int) -> int:
    """The largest power of two with chunk x V <= 2^29 logits (2048 rows for a 152 K or 248 K vocabulary).

    Past about 2^30 logits per chunk Inductor writes fp32 temporaries and the peak memory jumps, while smaller
    chunks cost no time (docs/benchmarks.md).
    """
    return 1 << max(0, (2**29 // vocab_size).bit_length() - 1)


def head_cross_entropy(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, chunk_size: int | None = None, top_k: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """CE [N] of every position through the frozen LM head (fp32, differentiable with respect to hidden),
    correct [N] bool (argmax == label) and the top_k highest-logit token ids [N, top_k] (int64; [N, 0] for 0).

    hidden [N, H] (the drafter's final-normed outputs), lm_head_weight [V, H] frozen: it never gets a gradient,
    so keep it in the matmul dtype (bf16 on GPU) to avoid a cast per call. labels [N] in [0, V). Logits exist one
    chunk of `chunk_size` rows at a time (None: default_chunk_size(V)); the forward keeps each row's gradient
    [N, H] (two LM-head matmuls per chunk, none in backward), so the CEs can be weighted by anything afterwards.
    """
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    chunk_size = chunk_size or default_chunk_size(lm_head_weight.shape[0])
    return _HeadCrossEntropy.apply(
        hidden, lm_head_weight, labels.long(), chunk_size, _matmul_dtype(hidden), need_grad, top_k
    )


# ---------------------------------------------------------------------------------------------- position weights

POSITION_WEIGHTS = ("decay", "dpace")


def dpace_weights(ce: Tensor, trained: Tensor, block_size: int, floor: float = 0.5) -> Tensor:
    """D-PACE position weights [N] (no gradient) from the CEs [N] of blocks in block-major order.

    Per block, q_i = exp(-CE_i) estimates the chance that draft i is accepted, q~_i = (1 - floor) q_i + floor
    (1 at untrained positions, so the anchor slot of a DFlash block counts as certain), and w_j = sum over m >= j of
    prod over i <= m of q~_i: how much the expected accepted length grows with log q_j. Untrained positions get 0.
    """
    q = torch.exp(-ce.detach().reshape(-1, block_size).to(torch.float32))
    on = trained.reshape(-1, block_size)
    smoothed = torch.where(on, (1 - floor) * q + floor, 1.0)
    reach = smoothed.cumprod(dim=1)
    weights = reach.flip(1).cumsum(dim=1).flip(1)
    return torch.where(on, weights, 0.0).flatten()


def position_weights(kind: str, ce: Tensor, weights: Tensor, block_size: int) -> Tensor:
    """The loss weights [N] of the block CEs [N]; the loss is sum(w * CE) / sum(normaliser(kind, weights)).

    weights: block_inputs' decayed weights, positive exactly where a position is trained. "decay" keeps them (the
    paper's loss); "dpace" replaces them by dpace_weights.
    """
    if kind == "decay":
        return weights
    return dpace_weights(ce, weights > 0, block_size).to(weights.dtype)


def normaliser(kind: str, weights: Tensor) -> Tensor:
    """What the weighted CEs are divided by, summed, for `kind`; it does not depend on the model, so a step knows
    its global total before the first forward. The decay: the weights' sum; D-PACE: the trained positions (as
    speculators normalises it)."""
    return weights if kind == "decay" else (weights > 0).to(weights.dtype)


class BlockStats(NamedTuple):
    """Sums over anchors (add them across steps or all-reduce them across ranks, then divide).

    accepted / anchors is the acceptance length: the mean over anchors of 1 (the bonus token) + the drafts
    temperature-0 verification would accept there. Anchors are uniform over response tokens; decoding's tau is a
    mean over verify rounds, which crowd into the stretches the drafter misses, so tau is lower (replay_decoding
    measures it)."""

    correct: Tensor  # [B-1] correct predictions at block positions k = 1..B-1, over weighted positions
    counted: Tensor  # [B-1] weighted (trained) positions at k = 1..B-1
    accepted: Tensor  # [] sum over counted anchors of 1 + the number of leading correct predictions
    anchors: Tensor  # [] counted anchors: those whose k = 1 position is trained
    # per block, not sums (`leading_runs`), for what splits the sums by block: the replay, the sources
    runs: Tensor  # [blocks] the drafts verification accepts
    counts: Tensor  # [blocks] bool: whether the block counts


def block_stats(correct: Tensor, weights: Tensor, block_size: int) -> BlockStats:
    """Accuracy per block position and acceptance length from block_cross_entropy's `correct` and the weights.

    correct / weights: [N] or [R, Q] in block-major order (as block_inputs makes them). A position counts when its
    weight is positive (valid anchor, loss mask on). A draft run stops at the first wrong or untrained position.
    """
    hit, trained = block_hits(correct, weights, block_size)
    run, counted_anchor = leading_runs(hit, trained)
    return BlockStats(
        correct=hit.sum(dim=0).float(),
        counted=trained.sum(dim=0).float(),
        accepted=((1 + run) * counted_anchor).sum().float(),
        anchors=counted_anchor.sum().float(),
        runs=run,
        counts=counted_anchor,
    )


def block_hits(correct: Tensor, weights: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """[blocks, B-1] correct-and-trained and trained flags of positions k = 1..B-1 (inputs as block_stats's)."""
    trained = weights.reshape(-1, block_size)[:, 1:] > 0
    return correct.reshape(-1, block_size)[:, 1:] & trained, trained


def leading_runs(hit: Tensor, trained: Tensor) -> tuple[Tensor, Tensor]:
    """Per block, from block_hits: the drafts temperature-0 verification accepts (the leading hits), and whether
    the block counts (its k = 1 position is trained). Both [blocks]."""
    return hit.long().cumprod(dim=1).sum(dim=1), trained[:, 0]


def replay_decoding(runs: np.ndarray) -> tuple[int, int]:
    """(verify rounds, committed tokens) of temperature-0 speculative decoding replayed over known answers.

    runs [R, T]: at every counted anchor the drafts accepted there (leading_runs), -1 elsewhere. A maximal
    stretch of counted anchors is one answer (the last B-1 positions of a document never anchor, so stretches of
    two documents never touch). Decoding anchors its first round on the stretch's first position and every next
    one on the token after those committed (a + run + 1), until it leaves the stretch; a round commits the
    accepted drafts and the target's own next token. Tokens / rounds is tau as `dflash eval` measures it when the
    answers are the target's greedy ones, and is lower than the mean over uniform anchors wherever the drafter's
    accuracy varies along the text: the rounds crowd into the stretches it misses.
    """
    rounds = tokens = 0
    for row in runs:
        edges = np.diff(np.concatenate([[0], (row >= 0).astype(np.int8), [0]]))
        for a, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            while a < end:
                rounds += 1
                tokens += int(row[a]) + 1
                a += int(row[a]) + 1
    return rounds, tokens
