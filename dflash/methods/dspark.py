"""DSpark (`Qwen3DSparkModel`): the DFlash backbone on blocks of 7 whose anchor slot drafts too, a Markov head that
makes each draft depend on the one before it, and a confidence head that predicts whether a draft is accepted.

    slot j of the block [anchor, MASK x (B-1)] at positions a + j predicts the token at a + j + 1 (B drafts)
    unary:       U_j = lm_head(h_j)
    Markov:      z_j = U_j + W2 e_j,  e_j = W1[x_{j-1}]   (x_{-1}: the anchor token; W1 [V, r], W2 [V, r])
    confidence:  c_j = sigmoid(w . [h_j ; e_j] + b)

Training (DeepSpec's loss, every term weighted by the trainer's position weights, exp(-j/4) for the default block
of 7): 0.1 CE(z_j, label) + 0.9 L1(p_d, p_t) + 1.0 BCE(c_j, 1 - TV(p_d, p_t)), with p_d = softmax(z_j) teacher-forced
(x_{j-1} the true token) and p_t the target's next-token distribution from the store's teacher arrays
(dflash.methods.distill: exact with `--teacher hidden`, over K + 1 outcomes with `--teacher topk:K`). TV = L1 / 2.
Decoding samples the Markov chain left to right (greedy at T = 0); `--confidence-cut X` ends a block's drafts
where the running product of the confidences falls below X (off by default, as in DeepSpec's eval).

W2 starts at zero, so an untrained DSpark drafter drafts what the plain LM head on its backbone would.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.drafter.model import INIT_STD, DFlashDrafter, DrafterConfig, acc_dtype
from dflash.drafter.proposers import DFlashProposer, Draft, inverse_cdf, uniforms
from dflash.errors import DflashError
from dflash.methods.base import Method, Objective, drafted_slots, with_slot0
from dflash.methods.distill import teacher_head_loss, teacher_logit_copies

CONFIDENCE_WEIGHT = 1.0  # DeepSpec's DSpark loss; its CE and L1 weights are distill's


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
        return teacher_logit_copies(teacher)

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
    got = teacher_head_loss(hidden, previous, head, w2, labels, weights, teacher, kind, span - 1, options.loss_chunk)
    total, terms, distance, w = got.total, got.terms, got.distance, got.weight
    if model.confidence_head is not None:
        accepted = (1 - distance / 2).clamp(0, 1)  # 1 - TV: the chance that verification accepts
        logits = model.confidence_head(hidden, previous)
        confidence = CONFIDENCE_WEIGHT * w * F.binary_cross_entropy_with_logits(logits, accepted, reduction="none")
        total, terms = total + confidence.sum(), terms + confidence.detach()
    return Objective(total, with_slot0(terms, span), with_slot0(got.correct, span))


# ---------------------------------------------------------------------------------------------- decoding


class DSparkProposer(DFlashProposer):
    """Samples the Markov chain left to right over the block's drafts (module docstring)."""

    def check_options(self, options) -> None:
        cut = options.confidence_cut
        if cut is not None and (self.drafter.confidence_head is None or not 0 <= cut <= 1):
            raise DflashError(
                f"--confidence-cut {cut} needs a DSpark drafter with a confidence head and a value in [0, 1]"
            )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_chain = self.device_part(self._draft_chain)

    def choose(self, hidden: Tensor, anchor: Tensor, temperature: float, generator) -> Draft:
        cut = self.options.confidence_cut
        draws = uniforms(hidden.shape[0], temperature, generator, hidden.device)
        # The target's LM head runs outside the compiled part: under tensor parallelism it is a sharded module.
        unary = self.head(hidden)
        tokens, probs, confidence = self.draft_chain(hidden, unary, anchor, draws, temperature, cut is not None)
        if cut is not None:
            keep = drafts_before_cut(confidence, cut)
            tokens, probs = tokens[:keep], None if probs is None else probs[:keep]
        return Draft(tokens, probs)

    def _draft_chain(
        self, hidden: Tensor, unary: Tensor, anchor: Tensor, draws: Tensor | None, temperature: float, confident: bool
    ):
        """From the LM head's logits unary [k, V]: (the drafts [k], at T > 0 the q [k, V] each was drawn from, with
        `confident` the confidence c_j [k]), all on the device: slot j's previous token is the anchor (j = 0) or the
        draft of slot j - 1, picked by argmax or by inverse_cdf of softmax(z_j / T) at draws[j]."""
        markov = self.drafter.markov_head
        previous, tokens, probs, confidence = anchor.reshape(1), [], [], []
        for j in range(hidden.shape[0]):
            e = markov.markov_w1(previous)
            if confident:
                confidence.append(torch.sigmoid(self.drafter.confidence_head(hidden[j : j + 1], e)))
            logits = (unary[j] + markov.markov_w2(e)[0]).float()
            if draws is None:
                pick = logits.argmax()
            else:
                q = torch.softmax(logits.double() / temperature, dim=-1)
                pick = inverse_cdf(q, draws[j])
                probs.append(q.float())
            tokens.append(pick)
            previous = pick.reshape(1)
        return torch.stack(tokens), torch.stack(probs) if probs else None, torch.cat(confidence) if confident else None


def drafts_before_cut(confidence: Tensor, cut: float) -> int:
    """How many drafts to keep: up to the first j > 0 whose running product of confidences c_0 .. c_j (the chance
    that drafts 0..j are all accepted) falls below `cut`; the first draft is always kept. One host sync."""
    reach = 1.0
    for j, c in enumerate(confidence.double().tolist()):
        reach *= c
        if reach < cut and j > 0:
            return j
    return len(confidence)


METHOD = Method(
    name="dspark",
    config_cls=DSparkConfig,
    model_cls=DSparkDrafter,
    proposer_cls=DSparkProposer,
    objective_fn=objective,
    teacher="required",
)
