"""The loss of a drafter head against the target's next-token distribution (DSpark's, and DFlash 2's with a
teacher store): per position, ce_weight x CE(z, label) + distance_weight x L1(softmax(z), p_t), with
z = [h, e] . [head, W2] (DSpark's Markov logits; e and W2 of width 0 for a plain LM head) and p_t read from the
store's teacher arrays: `--teacher hidden` gives p_t exactly (the target's LM head on its stored final hidden state),
`--teacher topk:K` its K most probable tokens and the mass of the rest, over which L1 is taken with the rest as one
outcome (the distance of the two distributions coarsened to those K + 1 outcomes; it never exceeds the true one).
TV = L1 / 2; 1 - TV is the chance that lossless verification accepts a token drawn from softmax(z).
"""

from typing import NamedTuple

import torch
from torch import Tensor

from dflash.drafter import graph, loss
from dflash.topk import vocab_top_k

TEACHER_ORDER = {"hidden": ("teacher_hidden",), "topk": ("teacher_ids", "teacher_probs", "teacher_tail")}
CE_WEIGHT, DISTANCE_WEIGHT = 0.1, 0.9  # DeepSpec's DSpark loss, which DFlash 2 from a teacher store takes too


class HiddenTeacher(NamedTuple):
    """A chunk's exact teacher: the target's logits [c, V] and their logsumexp [c] (made once, read by every pass)."""

    logits: Tensor
    lse: Tensor


def _teacher_chunk(teacher: tuple, rows: slice, head: Tensor, math_dtype) -> HiddenTeacher | tuple:
    """The teacher of a chunk: the target's logits and their logsumexp (hidden: one array), or (ids, probs, tail)."""
    if len(teacher) == 1:
        logits = teacher[0][rows].to(head.dtype) @ head.T
        return HiddenTeacher(logits, graph.stored(logits.to(math_dtype).logsumexp(dim=-1)))
    return tuple(values[rows] for values in teacher)


def _teacher_probs_at(target: HiddenTeacher | tuple, ids: Tensor) -> Tensor:
    """The target's probability [c, n] (fp32) of the tokens ids [c, n] from a chunk's teacher: exact from its logits
    (hidden), from a top-k teacher its probability where the token is one of its K and 0 elsewhere (a lower bound:
    such a token's share of the tail is unknown)."""
    if isinstance(target, HiddenTeacher):
        return (target.logits.gather(1, ids).to(target.lse.dtype) - target.lse[:, None]).exp().float()
    teacher_ids, teacher_probs, _ = target
    match = ids[:, :, None] == teacher_ids.long()[:, None, :]
    return (match * teacher_probs.float()[:, None, :]).sum(-1)


def _distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad):
    """L1 [c] between p = softmax(z) and the teacher, and (if need_grad) the gradient [c, V] of the chunk's loss
    ce_part * CE + distance_part * L1 with respect to z, in z's dtype:
        grad_z = p * (ce_part + distance_part * (s - <p, s>)) - ce_part * onehot(label),  s = sign(p - t)."""
    if isinstance(target, HiddenTeacher):
        return _hidden_distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)
    return _topk_distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)


def _hidden_distance_and_gradient(z, lse, ce, label, teacher, ce_part, distance_part, need_grad):
    """The same against the target's logits: t = exp(logits - lse_t) is made inside each [c, V] pass that reads
    it, and the gradient is written in z's dtype with the label's exact value scattered over it (a scatter_add
    into a float32 gradient stored all of it once more and copied it)."""
    teacher_logits, lse_t = teacher
    p = (z.to(lse.dtype) - lse[:, None]).exp()
    diff = p - (teacher_logits.to(lse.dtype) - lse_t[:, None]).exp()
    sign, distance = diff.sign(), diff.abs().sum(-1)
    if not need_grad:
        return distance, None
    p_dot_s = (p * sign).sum(-1, keepdim=True)
    # Not through graph.stored: two loads a logit, and stored would split the pass that makes p_dot_s from the
    # one that reads it (p and the sign then stored as [c, V] float32 between them, inductor's CPU code shows).
    off_sign = ce_part - distance_part * p_dot_s
    grad = (p * (off_sign + distance_part * sign)).to(z.dtype)
    # The label's sign from its own two values: a gather from `sign` made inductor store all of diff for it.
    p_label = (-ce).exp()[:, None]  # CE = lse - z[label]
    t_label = (teacher_logits.gather(1, label).to(lse.dtype) - lse_t[:, None]).exp()
    at_label = p_label * (off_sign + distance_part * (p_label - t_label).sign()) - ce_part
    return distance, grad.scatter_(1, label, at_label.to(z.dtype))


def _topk_distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad):
    """The same against a top-K teacher, over its K tokens and the rest as one outcome. Off the K ids s is the
    rest's sign, one value per row, so <p, s> and the distance need only the K gathered probabilities, and the
    gradient is one pass over z (a row scale times exp(z - lse)) with its K + 1 exact values written over it."""
    ids, probs, tail = target
    ids = ids.long()
    p_top = (z.gather(1, ids).to(lse.dtype) - lse[:, None]).exp()
    top_diff = p_top - probs.to(lse.dtype)
    rest_mass = 1 - p_top.sum(-1)
    rest_diff = rest_mass - tail.to(lse.dtype)
    distance = top_diff.abs().sum(-1) + rest_diff.abs()
    if not need_grad:
        return distance, None
    s_top, s_rest = top_diff.sign(), rest_diff.sign()[:, None]
    p_dot_s = s_rest * rest_mass[:, None] + (p_top * s_top).sum(-1, keepdim=True)

    def scale(sign):
        return ce_part + distance_part * (sign - p_dot_s)

    # The [c, V] pass reads the row's stored scale, not the seven values it is made of, per logit (graph.stored).
    grad = (graph.stored(scale(s_rest)) * (z.to(lse.dtype) - lse[:, None]).exp()).to(z.dtype)
    is_label = ids == label
    s_label = torch.where(is_label.any(-1, keepdim=True), (s_top * is_label).sum(-1, keepdim=True), s_rest)
    p_label = (-ce).exp()[:, None]  # CE = lse - z[label]
    at_label = p_label * scale(s_label) - ce_part
    # The K + 1 exact values in one scatter (a second one copied all of grad): where the label is one of the K ids,
    # both of its writes carry the label's value.
    at_ids = torch.where(is_label, at_label, p_top * scale(s_top))
    exact = torch.cat([at_ids, at_label], dim=1).to(z.dtype)
    return distance, grad.scatter_(1, torch.cat([ids, label], dim=1), exact)


def _chunk_size(rows: int, target: int, block: int) -> int:
    """Whole blocks, at most `target` rows (or one block), and chunks of even size: no last chunk of a few rows
    that reads the whole [V, H] head for them."""
    blocks, most = -(-rows // block), max(1, target // block)
    count = -(-blocks // most)
    return -(-blocks // count) * block


class _TeacherHeadLoss(torch.autograd.Function):
    """The weighted loss sum_i w_i (a CE_i + b L1_i) under the logits z = head h + W2 e, chunked ([N x V] never
    exists), with per position the CE, the L1 distance of softmax(z) to the teacher, whether argmax z is the label
    and the weight w. Each row's weight is known in the forward (the trainer's, or D-PACE's from the CEs of its own
    block: a chunk holds whole blocks), so a chunk's gradient with respect to its logits is known as soon as they
    are, and goes at once through the head to hidden, through W2 to e and into W2's gradient: the logits are made
    once, and backward only scales the three gradients by the loss's upstream one."""

    @staticmethod
    def forward(
        ctx, hidden, previous, head, w2, labels, weights, kind, span, chunk_size, mm_dtype, need_grad, parts, *teacher
    ):
        ce_weight, distance_weight, top_k = parts
        h, e, head, w2_mm = (t.to(mm_dtype) for t in (hidden, previous, head, w2))
        # z = head h + W2 e as one product over [h, e] and [head, W2]: its r extra columns cost a tenth of the head's
        # product, where W2's product added into the head's (addmm) moved the [c, V] logits twice more, at 192
        # TFLOP/s (10.9 ms of a 231 ms step: docs/benchmarks.md, "Drafter methods").
        if w2.shape[1]:  # [N, H + r], [V, H + r]
            joint_input, joint_weight = torch.cat([h, e], dim=1), torch.cat([head, w2_mm], dim=1)
        else:  # no Markov term (DFlash 2): the head itself, not a copy of it
            joint_input, joint_weight = h, head
        math_dtype = torch.promote_types(mm_dtype, torch.float32)
        ces, distances, corrects, ws, tops, tops_teacher = [], [], [], [], [], []
        if need_grad:  # not in validation steps
            grad_hidden, grad_previous = torch.empty_like(hidden), torch.empty_like(previous)
            grad_w2 = torch.zeros_like(w2)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            label = labels[rows, None]
            z = joint_input[rows] @ joint_weight.T  # stays in mm_dtype: every pass below reads it once
            # lse and w stored (graph.stored): the [c, V] passes below read them per logit (D-PACE's w is made from
            # a block's CEs)
            lse = graph.stored(z.to(math_dtype).logsumexp(dim=-1))
            ce = lse - z.gather(1, label)[:, 0].to(math_dtype)
            w = graph.stored(loss.position_weights(kind, ce, weights[rows], span).to(math_dtype))
            ce_part, distance_part = (ce_weight * w)[:, None], (distance_weight * w)[:, None]
            target = _teacher_chunk(teacher, rows, head, math_dtype)
            distance, grad_z = _distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)
            ces.append(ce)
            distances.append(distance)
            corrects.append(z.argmax(dim=-1) == labels[rows])
            ws.append(w)
            if top_k:  # DFlash 2's candidates: the unary logits' top K, from the chunk's logits while they exist,
                # with the target's p at them and at the label (a hidden teacher's logits are made once, here)
                tops.append(vocab_top_k(z, top_k)[1])
                tops_teacher.append(_teacher_probs_at(target, torch.cat([tops[-1], label], dim=1)))
            if need_grad:
                grad_hidden[rows] = (grad_z @ head).to(hidden.dtype)
                if w2.shape[1]:
                    grad_previous[rows] = (grad_z @ w2_mm).to(previous.dtype)
                    grad_w2 += (grad_z.T @ e[rows]).to(w2.dtype)
        ce, distance, correct, w = torch.cat(ces), torch.cat(distances), torch.cat(corrects), torch.cat(ws)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_previous, grad_w2)
        top = torch.cat(tops) if top_k else labels.new_empty(labels.shape[0], 0)
        top_teacher = torch.cat(tops_teacher) if top_k else ce.new_empty(labels.shape[0], 0)
        terms = w * (ce_weight * ce + distance_weight * distance)
        ctx.mark_non_differentiable(terms, ce, distance, correct, w, top, top_teacher)
        return terms.sum(), terms, ce, distance, correct, w, top, top_teacher

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_hidden, grad_previous, grad_w2 = (g * grad_total.to(g.dtype) for g in ctx.saved_tensors)
        return grad_hidden, grad_previous, None, grad_w2, *(None for _ in ctx.needs_input_grad[4:])


def teacher_logit_copies(teacher: str | None) -> float:
    """fp32 [loss chunk x V] logits the loss keeps at its peak on a GPU (DrafterConfig.loss_logit_copies).

    Fitted to bench/train.py's drafter b as DSpark (12288 tokens, 2048 anchors, default chunk): 27.3 GB peak with a
    top-k teacher (2026-12-03 13:19 UTC: the gradient pass writes over z, one scatter, the joint [head, W2] operand
    of 1.4 GB, 7-row blocks) and 31.2 GB with the hidden one (2026-12-03 15:06 UTC: z, the teacher's logits and
    grad z in bf16), where the rest of the formula gives 23.1 GB (docs/training.md, "Memory")."""
    return 3.95 if teacher == "hidden" else 2.05


class TeacherLoss(NamedTuple):
    total: Tensor  # [] sum_i w_i (ce_weight CE_i + distance_weight L1_i), the one differentiable output
    terms: Tensor  # [N] w_i (ce_weight CE_i + distance_weight L1_i)
    ce: Tensor  # [N]
    distance: Tensor  # [N] L1 between softmax(z) and the teacher (twice the total variation)
    correct: Tensor  # [N] bool: argmax z is the label
    weight: Tensor  # [N] w
    top: Tensor  # [N, top_k] int64 ids of z's top_k largest logits ([N, 0] for top_k 0)
    top_teacher: Tensor  # [N, top_k + 1] fp32 the target's p at `top` and, last, at the label ([N, 0] for top_k 0)


def teacher_head_loss(
    hidden,
    previous,
    head,
    w2,
    labels,
    weights,
    teacher: dict,
    kind="decay",
    span=1,
    chunk_size=None,
    ce_weight=CE_WEIGHT,
    distance_weight=DISTANCE_WEIGHT,
    top_k=0,
) -> TeacherLoss:
    """The logits z = head h + W2 e (previous: e [N, r], w2 [V, r]; r may be 0) against labels and teacher
    (module docstring), differentiable through `total` only. weights [N]: the trainer's; kind:
    loss.POSITION_WEIGHTS, over blocks of `span` rows; teacher: the per-position teacher arrays (teacher_hidden
    [N, H], or teacher_ids / teacher_probs [N, K] and teacher_tail [N])."""
    target = chunk_size or max(1, loss.default_chunk_size(head.shape[0]) // 2)  # a chunk holds ~4 [c, V]
    chunk_size = _chunk_size(hidden.shape[0], target, span)  # whole blocks: D-PACE weighs a block from its own CEs
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or previous.requires_grad or w2.requires_grad)
    source = "hidden" if "teacher_hidden" in teacher else "topk"
    arrays = (teacher[name] for name in TEACHER_ORDER[source])
    settings = (kind, span, chunk_size, loss._matmul_dtype(hidden), need_grad, (ce_weight, distance_weight, top_k))
    return TeacherLoss(*_TeacherHeadLoss.apply(hidden, previous, head, w2, labels.long(), weights, *settings, *arrays))
