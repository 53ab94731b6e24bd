"""DSpark (`Qwen3DSparkModel`): the DFlash backbone on blocks of 7 whose anchor slot drafts too, a Markov head that
makes each draft depend on the one before it, and a confidence head that predicts whether a draft is accepted.

    slot j of the block [anchor, MASK x (B-1)] at positions a + j predicts the token at a + j + 1 (B drafts)
    unary:       U_j = lm_head(h_j)
    Markov:      z_j = U_j + W2 e_j,  e_j = W1[x_{j-1}]   (x_{-1}: the anchor token; W1 [V, r], W2 [V, r])
    confidence:  c_j = sigmoid(w . [h_j ; e_j] + b)

Training (DeepSpec's loss, every term weighted by the trainer's position weights, exp(-j/4) for the default block
of 7): 0.1 CE(z_j, label) + 0.9 L1(p_d, p_t) + 1.0 BCE(c_j, 1 - TV(p_d, p_t)), with p_d = softmax(z_j) teacher-forced
(x_{j-1} the true token) and p_t the target's next-token distribution, read from the store's teacher arrays:
`--teacher hidden` gives p_t exactly (the target's LM head on its stored final hidden state), `--teacher topk:K`
its K most probable tokens and the mass of the rest, over which L1 is taken with the rest as one outcome (the
distance of the two distributions coarsened to those K + 1 outcomes; it never exceeds the true one). TV = L1 / 2.
Decoding samples the Markov chain left to right (greedy at T = 0); `--confidence-cut X` ends a block's drafts
where the running product of the confidences falls below X (off by default, as in DeepSpec's eval).

W2 starts at zero, so an untrained DSpark drafter drafts what the plain LM head on its backbone would.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash import graph, loss
from dflash.drafter import INIT_STD, DFlashDrafter, DrafterConfig, acc_dtype
from dflash.errors import DflashError
from dflash.methods.base import Method, Objective, drafted_slots, with_slot0
from dflash.proposers import DFlashProposer, Draft, draw

CE_WEIGHT, DISTANCE_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0  # DeepSpec's DSpark loss


@dataclass(kw_only=True)
class DSparkConfig(DrafterConfig):
    block_size: int = 7
    markov_rank: int = 256  # r of W1 and W2
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head reads [h ; W1[previous token]], not h alone
    num_anchors: int | None = None  # anchors per training row; the trainer records its own (DeepSpec's loader reads it)

    method: ClassVar[str] = "dspark"
    architecture: ClassVar[str] = "Qwen3DSparkModel"
    anchor_predicts: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.markov_rank < 1 or self.block_size < 1:
            raise DflashError(
                f"invalid DSpark drafter: markov_rank {self.markov_rank} and block_size {self.block_size} must be "
                "positive; fix them with --drafter-option / --block-size"
            )

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict:
        config = super().to_hf_config(dtype)
        config.update(
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_anchors=self.num_anchors,
            markov_rank=self.markov_rank,
            markov_head_type="vanilla",
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov,
        )
        return config

    @classmethod
    def extra_from_hf(cls, dflash_field) -> dict:
        kind = dflash_field("markov_head_type", "vanilla")
        if kind != "vanilla":
            raise DflashError(f"the drafter's markov_head_type is {kind!r}; dflash reads the vanilla Markov head only")
        anchors = dflash_field("num_anchors", None)
        return dict(
            markov_rank=int(dflash_field("markov_rank", cls.markov_rank)),
            enable_confidence_head=bool(dflash_field("enable_confidence_head", cls.enable_confidence_head)),
            confidence_head_with_markov=bool(
                dflash_field("confidence_head_with_markov", cls.confidence_head_with_markov)
            ),
            num_anchors=None if anchors is None else int(anchors),
        )

    @property
    def confidence_width(self) -> int:
        return self.hidden_size + self.markov_rank * self.confidence_head_with_markov

    def method_flops_per_token(self) -> float:
        markov = 2 * self.markov_rank * self.vocab_size  # W2 e over the vocabulary
        return markov + (2 * self.confidence_width if self.enable_confidence_head else 0)

    def loss_logit_copies(self, teacher: str | None) -> float:
        # Fitted to bench/train.py's drafter b (12288 tokens, 2048 anchors, default chunk): 27.3 GB peak with a
        # top-k teacher (2026-12-03 13:19 UTC: the gradient pass writes over z, one scatter, the joint [head, W2]
        # operand of 1.4 GB, 7-row blocks; 30.9 GB when a second scatter copied grad z) and 31.2 GB with the hidden
        # one (2026-12-03 15:06 UTC: z, the teacher's logits and grad z in bf16, no float32 [c, V]; 32.9 GB when p_t
        # and grad z were float32), where the rest of the formula gives 23.1 GB (docs/training.md, "Memory").
        return 3.95 if teacher == "hidden" else 2.05

    def extra_keys(self) -> list[str]:
        keys = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        if self.enable_confidence_head:
            keys += ["confidence_head.proj.weight", "confidence_head.proj.bias"]
        return keys


class MarkovHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=INIT_STD)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        self.proj = nn.Linear(cfg.confidence_width, 1)
        nn.init.normal_(self.proj.weight, std=INIT_STD)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor, previous: Tensor) -> Tensor:
        """The confidence logits [N], at least fp32 (elementwise, so that autocast keeps them out of bf16)."""
        features = torch.cat([hidden, previous.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        acc = acc_dtype(features.dtype)
        return (features.to(acc) * self.proj.weight[0].to(acc)).sum(-1) + self.proj.bias.to(acc)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None


# ---------------------------------------------------------------------------------------------- the loss


TEACHER_ORDER = {"hidden": ("teacher_hidden",), "topk": ("teacher_ids", "teacher_probs", "teacher_tail")}


def _teacher_chunk(teacher: tuple, rows: slice, head: Tensor) -> Tensor | tuple:
    """The teacher of a chunk: the target's logits [c, V] (hidden: one array), or (ids, probs, tail)."""
    if len(teacher) == 1:
        return teacher[0][rows].to(head.dtype) @ head.T
    return tuple(values[rows] for values in teacher)


def _distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad):
    """L1 [c] between p = softmax(z) and the teacher, and (if need_grad) the gradient [c, V] of the chunk's loss
    ce_part * CE + distance_part * L1 with respect to z, in z's dtype:
        grad_z = p * (ce_part + distance_part * (s - <p, s>)) - ce_part * onehot(label),  s = sign(p - t)."""
    if isinstance(target, Tensor):
        return _hidden_distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)
    return _topk_distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)


def _hidden_distance_and_gradient(z, lse, ce, label, teacher_logits, ce_part, distance_part, need_grad):
    """The same against the target's logits: t = exp(logits - lse_t) is made inside each [c, V] pass that reads
    it, and the gradient is written in z's dtype with the label's exact value scattered over it (a scatter_add
    into a float32 gradient stored all of it once more and copied it)."""
    lse_t = graph.stored(teacher_logits.to(lse.dtype).logsumexp(dim=-1))
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


class _MarkovHeadLoss(torch.autograd.Function):
    """The weighted loss sum_i w_i (0.1 CE_i + 0.9 L1_i) under the logits z = head h + W2 e, chunked ([N x V] never
    exists), with per position the CE, the L1 distance of softmax(z) to the teacher, whether argmax z is the label
    and the weight w. Each row's weight is known in the forward (the trainer's, or D-PACE's from the CEs of its own
    block: a chunk holds whole blocks), so a chunk's gradient with respect to its logits is known as soon as they
    are, and goes at once through the head to hidden, through W2 to e and into W2's gradient: the logits are made
    once, and backward only scales the three gradients by the loss's upstream one."""

    @staticmethod
    def forward(
        ctx, hidden, previous, head, w2, labels, weights, kind, span, chunk_size, mm_dtype, need_grad, *teacher
    ):
        h, e, head, w2_mm = (t.to(mm_dtype) for t in (hidden, previous, head, w2))
        # z = head h + W2 e as one product over [h, e] and [head, W2]: its r extra columns cost a tenth of the head's
        # product, where W2's product added into the head's (addmm) moved the [c, V] logits twice more, at 192
        # TFLOP/s (10.9 ms of a 231 ms step: docs/benchmarks.md, "Drafter methods").
        joint_input, joint_weight = torch.cat([h, e], dim=1), torch.cat([head, w2_mm], dim=1)  # [N, H + r], [V, H + r]
        math_dtype = torch.promote_types(mm_dtype, torch.float32)
        ces, distances, corrects, ws = [], [], [], []
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
            ce_part, distance_part = (CE_WEIGHT * w)[:, None], (DISTANCE_WEIGHT * w)[:, None]
            target = _teacher_chunk(teacher, rows, head)
            distance, grad_z = _distance_and_gradient(z, lse, ce, label, target, ce_part, distance_part, need_grad)
            ces.append(ce)
            distances.append(distance)
            corrects.append(z.argmax(dim=-1) == labels[rows])
            ws.append(w)
            if need_grad:
                grad_hidden[rows] = (grad_z @ head).to(hidden.dtype)
                grad_previous[rows] = (grad_z @ w2_mm).to(previous.dtype)
                grad_w2 += (grad_z.T @ e[rows]).to(w2.dtype)
        ce, distance, correct, w = torch.cat(ces), torch.cat(distances), torch.cat(corrects), torch.cat(ws)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_previous, grad_w2)
        ctx.mark_non_differentiable(ce, distance, correct, w)
        return (w * (CE_WEIGHT * ce + DISTANCE_WEIGHT * distance)).sum(), ce, distance, correct, w

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_hidden, grad_previous, grad_w2 = (g * grad_total.to(g.dtype) for g in ctx.saved_tensors)
        return grad_hidden, grad_previous, None, grad_w2, *(None for _ in ctx.needs_input_grad[4:])


def markov_head_loss(hidden, previous, head, w2, labels, weights, teacher: dict, kind="decay", span=1, chunk_size=None):
    """The Markov logits head h + W2 e against labels and teacher: (the weighted loss sum_i w_i (0.1 CE_i + 0.9 L1_i)
    [], and per position CE [N], L1 distance to the teacher [N], correct [N] bool, weight w [N]), differentiable
    through the first only. weights [N]: the trainer's; kind: loss.POSITION_WEIGHTS, over blocks of `span` rows;
    teacher: the per-position teacher arrays (teacher_hidden [N, H], or teacher_ids / teacher_probs [N, K] and
    teacher_tail [N])."""
    target = chunk_size or max(1, loss.default_chunk_size(head.shape[0]) // 2)  # a chunk holds ~4 [c, V]
    chunk_size = _chunk_size(hidden.shape[0], target, span)  # whole blocks: D-PACE weighs a block from its own CEs
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or previous.requires_grad or w2.requires_grad)
    source = "hidden" if "teacher_hidden" in teacher else "topk"
    arrays = (teacher[name] for name in TEACHER_ORDER[source])
    settings = (kind, span, chunk_size, loss._matmul_dtype(hidden), need_grad)
    return _MarkovHeadLoss.apply(hidden, previous, head, w2, labels.long(), weights, *settings, *arrays)


def objective(model, hidden, head, labels, weights, span, options, teacher=None) -> Objective:
    if not teacher:
        raise DflashError(
            "DSpark trains against the target's next-token distribution: harvest the store with --teacher hidden "
            "or --teacher topk:K"
        )
    previous = drafted_slots(labels.roll(1), span)  # slot k's previous token is slot k - 1's label
    hidden, labels, weights = (drafted_slots(t, span) for t in (hidden, labels, weights))
    previous = model.markov_head.markov_w1(previous)
    teacher = {name: drafted_slots(values, span) for name, values in teacher.items()}
    w2, kind = model.markov_head.markov_w2.weight, options.position_weights
    total, ce, distance, correct, w = markov_head_loss(
        hidden, previous, head, w2, labels, weights, teacher, kind, span - 1, options.loss_chunk
    )
    terms = w * (CE_WEIGHT * ce + DISTANCE_WEIGHT * distance)
    if model.confidence_head is not None:
        accepted = (1 - distance / 2).clamp(0, 1)  # 1 - TV: the chance that verification accepts
        logits = model.confidence_head(hidden, previous)
        confidence = w * F.binary_cross_entropy_with_logits(logits, accepted, reduction="none")
        total, terms = total + confidence.sum(), terms + confidence.detach()
    return Objective(total, with_slot0(terms, span), with_slot0(correct, span))


# ---------------------------------------------------------------------------------------------- decoding


class DSparkProposer(DFlashProposer):
    """Samples the Markov chain left to right over the block's drafts (module docstring)."""

    def check_options(self, options) -> None:
        cut = options.confidence_cut
        if cut is not None and (self.drafter.confidence_head is None or not 0 <= cut <= 1):
            raise DflashError(
                f"--confidence-cut {cut} needs a DSpark drafter with a confidence head and a value in [0, 1]"
            )

    def choose(self, hidden: Tensor, anchor: Tensor, temperature: float, generator) -> Draft:
        markov, cut = self.drafter.markov_head, self.options.confidence_cut
        unary = self.head(hidden)
        previous, tokens, probs, reach = anchor.reshape(1), [], [], 1.0
        for j in range(hidden.shape[0]):
            e = markov.markov_w1(previous)
            if cut is not None:  # the chance that drafts 0..j are all accepted; the first draft is always made
                reach *= float(torch.sigmoid(self.drafter.confidence_head(hidden[j : j + 1], e)))
                if reach < cut and j > 0:
                    break
            pick = draw((unary[j : j + 1] + markov.markov_w2(e)).float(), temperature, generator)
            tokens.append(pick.tokens)
            if pick.probs is not None:
                probs.append(pick.probs)
            previous = pick.tokens
        return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)


METHOD = Method(
    name="dspark",
    config_cls=DSparkConfig,
    model_cls=DSparkDrafter,
    proposer_cls=DSparkProposer,
    objective_fn=objective,
    needs_teacher=True,
)
