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

from dflash import loss
from dflash.drafter import INIT_STD, DFlashDrafter, DrafterConfig, acc_dtype
from dflash.errors import DflashError
from dflash.methods.base import Method, Objective
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
        # Fitted to bench/train.py's drafter b (12288 tokens, 2048 anchors, default chunk): 32.6 GB peak with a
        # top-k teacher and 40.8 GB with the hidden one, where the rest of the formula gives 23.2 GB; the backward
        # holds p, its sign and grad z of a chunk, and with `hidden` the teacher's logits and p_t too (docs/training.md,
        # "Memory"). Measured with the two products of `_logits` apart, as they are again (and a [c, V] one-hot in
        # the backward, a scatter since); the joint [head, W2] matmul tried between measured 34.8 GB (top-k).
        return 8.65 if teacher == "hidden" else 4.6

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


def _teacher_chunk(teacher: tuple, rows: slice, head: Tensor, math_dtype) -> Tensor | tuple:
    """The teacher of a chunk: the target's probabilities [c, V] (hidden: one array), or (ids, probs, tail)."""
    if len(teacher) == 1:
        logits = teacher[0][rows].to(head.dtype) @ head.T
        return torch.softmax(logits.to(math_dtype), dim=-1)
    return tuple(values[rows] for values in teacher)


def _distance(p: Tensor, target, math_dtype) -> Tensor:
    """L1 [c] between p [c, V] and the teacher (topk: over its K tokens and the rest as one outcome)."""
    if isinstance(target, Tensor):
        return (p - target).abs().sum(-1)
    top_diff, rest_diff, _ = _topk_differences(p, target, math_dtype)
    return top_diff.abs().sum(-1) + rest_diff.abs()


def _distance_sign(p: Tensor, target, math_dtype) -> Tensor:
    """The sign s [c, V] of p - t at every token, which the gradient of `_distance` needs (backward only)."""
    if isinstance(target, Tensor):
        return (p - target).sign()
    top_diff, rest_diff, ids = _topk_differences(p, target, math_dtype)
    return rest_diff.sign()[:, None].expand_as(p).scatter(1, ids, top_diff.sign())


def _topk_differences(p: Tensor, target: tuple, math_dtype) -> tuple[Tensor, Tensor, Tensor]:
    """p - t on the teacher's K tokens [c, K], on the rest lumped [c], and the K ids (int64)."""
    ids, probs, tail = target
    ids = ids.long()
    top = p.gather(1, ids)
    return top - probs.to(math_dtype), (1 - top.sum(-1)) - tail.to(math_dtype), ids


def _logits(hidden: Tensor, previous: Tensor, head: Tensor, w2: Tensor) -> Tensor:
    """z = head h + W2 e of a chunk [c, V]: W2's product accumulates into the head's in place (addmm_), so that no
    second [c, V] product is written, and no [V, H + r] copy of the two weights is made (a joint matmul over
    [h, e] costs 1.4 GB more at V = 248320 and measured no faster: docs/benchmarks.md, issue 23)."""
    return (hidden @ head.T).addmm_(previous, w2.T)


class _MarkovHeadLoss(torch.autograd.Function):
    """Per position, under the logits z = head h + W2 e (chunked: [N x V] never exists): the CE of the label, the
    L1 distance of softmax(z) to the teacher, and whether argmax z is the label. Backward recomputes each chunk's
    logits: the gradient through L1 needs the upstream gradient of every row before W2's can be summed."""

    @staticmethod
    def forward(ctx, hidden, previous, head, w2, labels, chunk_size, mm_dtype, *teacher):
        h, e, head, w2_mm = (t.to(mm_dtype) for t in (hidden, previous, head, w2))
        math_dtype = torch.promote_types(mm_dtype, torch.float32)
        ces, distances, corrects = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = _logits(h[rows], e[rows], head, w2_mm).to(math_dtype)
            lse = z.logsumexp(dim=-1)
            ces.append(lse - z.gather(1, labels[rows, None])[:, 0])
            corrects.append(z.argmax(dim=-1) == labels[rows])
            p = (z - lse[:, None]).exp()
            distances.append(_distance(p, _teacher_chunk(teacher, rows, head, math_dtype), math_dtype))
        ctx.save_for_backward(hidden, previous, head, w2, labels, *teacher)
        ctx.chunk_size, ctx.mm_dtype = chunk_size, mm_dtype
        correct = torch.cat(corrects)
        ctx.mark_non_differentiable(correct)
        return torch.cat(ces), torch.cat(distances), correct

    @staticmethod
    def backward(ctx, grad_ce, grad_distance, _):
        hidden, previous, head, w2, labels, *teacher = ctx.saved_tensors
        mm_dtype = ctx.mm_dtype
        math_dtype = torch.promote_types(mm_dtype, torch.float32)
        h, e, head_mm, w2_mm = (t.to(mm_dtype) for t in (hidden, previous, head, w2))
        grad_hidden, grad_previous, grad_w2 = torch.empty_like(hidden), torch.empty_like(previous), torch.zeros_like(w2)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            p = torch.softmax(_logits(h[rows], e[rows], head_mm, w2_mm).to(math_dtype), dim=-1)
            sign = _distance_sign(p, _teacher_chunk(teacher, rows, head, math_dtype), math_dtype)
            # dCE/dz = p - onehot; dL1/dz = p * (s - <p, s>) with s = sign(p - t)
            g_ce = grad_ce[rows, None].to(math_dtype)
            grad_z = g_ce * p + grad_distance[rows, None].to(math_dtype) * p * (sign - (p * sign).sum(-1, keepdim=True))
            grad_z = grad_z.scatter_add_(1, labels[rows, None], -g_ce).to(mm_dtype)
            grad_hidden[rows] = (grad_z @ head_mm).to(hidden.dtype)
            grad_previous[rows] = (grad_z @ w2_mm).to(previous.dtype)
            grad_w2 += (grad_z.T @ e[rows]).to(w2.dtype)
        return grad_hidden, grad_previous, None, grad_w2, None, None, None, *(None for _ in teacher)


def markov_head_loss(hidden, previous, head, w2, labels, teacher: dict, chunk_size=None):
    """(CE [N], L1 distance to the teacher [N], correct [N] bool) of the Markov logits head h + W2 e; teacher: the
    per-position teacher arrays (teacher_hidden [N, H], or teacher_ids / teacher_probs [N, K] and teacher_tail [N])."""
    chunk_size = chunk_size or max(1, loss.default_chunk_size(head.shape[0]) // 2)  # backward holds ~4 [c, V]
    kind = "hidden" if "teacher_hidden" in teacher else "topk"
    arrays = (teacher[name] for name in TEACHER_ORDER[kind])
    return _MarkovHeadLoss.apply(
        hidden, previous, head, w2, labels.long(), chunk_size, loss._matmul_dtype(hidden), *arrays
    )


def objective(model, hidden, head, labels, weights, span, options, teacher=None) -> Objective:
    if not teacher:
        raise DflashError(
            "DSpark trains against the target's next-token distribution: harvest the store with --teacher hidden "
            "or --teacher topk:K"
        )
    previous = model.markov_head.markov_w1(labels.roll(1))  # slot k's previous token is slot k - 1's label
    ce, distance, correct = markov_head_loss(
        hidden, previous, head, model.markov_head.markov_w2.weight, labels, teacher, options.loss_chunk
    )
    w = loss.position_weights(options.position_weights, ce, weights, span)
    terms = CE_WEIGHT * ce + DISTANCE_WEIGHT * distance
    if model.confidence_head is not None:
        accepted = (1 - distance.detach() / 2).clamp(0, 1)  # 1 - TV: the chance that verification accepts
        logits = model.confidence_head(hidden, previous)
        terms = terms + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(logits, accepted, reduction="none")
    terms = w * terms
    return Objective(terms.sum(), terms.detach(), correct)


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
