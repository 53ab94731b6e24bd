"""DFlash 2 (`DFlash2DraftModel`): the DFlash backbone with a grouped dynamic causal conv around attention and MLP in
every layer, and a candidate selector that re-scores the LM head's top-K tokens given the previous token.

    per layer:  h = x + finish(attn(prepare(norm(x))));  out = h + finish(mlp(prepare(norm(h))))
    prepare:    y_t = sum_{o<K} (base[0][o] + d0[t, o, g(c)]) * x_{t-o}   (d = kernel_projection(x), kept for finish)
    finish:     the same with base[1] and d1, on the sublayer's output; taps never cross a block boundary
    unary:      U_l = lm_head(h_l) * output_multiplier
    edge:       S_l(p -> c) = U_l[c] + <A[p] * (P h_l), B[c]>   over the K candidates c = top-K(U_l)

Decoding walks a block left to right from the verified anchor token: the previous token p of slot l is the
anchor (l = 1) or the token chosen at l - 1; greedy takes the best edge, at T > 0 a sample of softmax(S / T) over
the K candidates, and that K-way q is what verification checks against. Training: the paper's block CE on U plus
`selector_weight` x the CE of the edge scores over the candidates with the true previous token as predecessor
(teacher forcing equals decoding along every accepted prefix, so the teacher-forced argmax is the replay's draft).
Conv and selector start as the identity and the plain LM head (base taps [1, 0, ...], zero projection and
successor codebook): an untrained DFlash 2 drafter is a DFlash one with extra parameters.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from dflash.drafter import loss
from dflash.drafter.model import INIT_STD, DFlashDrafter, DrafterConfig, Layer, acc_dtype
from dflash.drafter.proposers import DFlashProposer, Draft, inverse_cdf, uniforms
from dflash.errors import DflashError
from dflash.methods.base import Method, Objective, drafted_slots, with_slot0
from dflash.methods.distill import CE_WEIGHT, DISTANCE_WEIGHT, teacher_head_loss, teacher_logit_copies
from dflash.topk import vocab_top_k


@dataclass(kw_only=True)
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2  # K taps, the current token's included
    conv_group_size: int = 16  # channels sharing one dynamic coefficient; divides hidden_size
    selector_rank: int = 256  # r of the codebooks and the hidden projection
    selector_top_k: int = 16  # candidates the selector scores per slot
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # read and decoded; training refuses it (see objective)
    input_embedding_scale: float = 1.0
    sliding_window: int | None = 2048  # the released configs' window over the context

    method: ClassVar[str] = "dflash2"
    architecture: ClassVar[str] = "DFlash2DraftModel"

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(
                f"conv_kernel_size {self.conv_kernel_size} and conv_group_size {self.conv_group_size} must be positive, "
                f"the group size dividing hidden_size {self.hidden_size}"
            )
        if self.conv_kernel_size > self.block_size:  # taps past the block's start would never see a token
            problems.append(f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}")
        if not 1 <= self.selector_top_k <= self.vocab_size or self.selector_rank < 1:
            problems.append(
                f"selector_top_k {self.selector_top_k} must be in 1..vocab_size and selector_rank "
                f"{self.selector_rank} positive"
            )
        if problems:
            raise DflashError(f"invalid DFlash 2 drafter: {'; '.join(problems)}; fix them with --drafter-option")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict:
        config = super().to_hf_config(dtype)
        config["dflash_config"].update(
            conv_kernel_size=self.conv_kernel_size,
            conv_group_size=self.conv_group_size,
            selector_rank=self.selector_rank,
            selector_top_k=self.selector_top_k,
            output_multiplier=self.output_multiplier,
            input_embedding_scale=self.input_embedding_scale,
        )
        if self.final_logit_softcapping is not None:  # absent means off to every engine
            config["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        return config

    @classmethod
    def extra_from_hf(cls, dflash_field) -> dict:
        defaults = {f: getattr(cls, f) for f in ("conv_kernel_size", "conv_group_size", "selector_rank")}
        defaults |= {"selector_top_k": cls.selector_top_k, "output_multiplier": cls.output_multiplier}
        fields = {name: int(dflash_field(name, default)) for name, default in defaults.items()}
        fields["output_multiplier"] = float(dflash_field("output_multiplier", cls.output_multiplier))
        cap = dflash_field("final_logit_softcapping", None)
        fields["final_logit_softcapping"] = None if cap is None else float(cap)
        fields["input_embedding_scale"] = float(dflash_field("input_embedding_scale", cls.input_embedding_scale))
        return fields

    def method_flops_per_token(self) -> float:
        H, K, r = self.hidden_size, self.selector_top_k, self.selector_rank
        convs = self.num_layers * 2 * (2 * H * 2 * self.conv_kernel_size * self.conv_groups)  # two projections a layer
        return convs + 2 * H * r + 2 * K * H + 2 * K * r  # P h, candidate logits, edge scores

    def loss_logit_copies(self, teacher: str | None) -> float:
        return super().loss_logit_copies(None) if teacher is None else teacher_logit_copies(teacher)

    def method_activation_copies(self, recompute: str = "none") -> float:
        if recompute == "pointwise":  # down_proj's output and the two kernel projections' (counted: test_memory)
            return 1 + 2 * 2 * self.conv_kernel_size * self.conv_groups / self.hidden_size
        # Fitted to one measurement (bench/train.py drafter b: 43.7 GB peak against DFlash's 33.3 GB, of which the
        # extra parameters are 2.6 GB; 2026-12-03, slot 0 skipped); docs/training.md, "Memory".
        return 9.7

    def extra_layer_keys(self) -> list[str]:
        return [f"{conv}.{name}" for conv in ("attention_conv", "mlp_conv") for name in CONV_KEYS]

    def extra_keys(self) -> list[str]:
        return [f"candidate_selector.{name}" for name in SELECTOR_KEYS]


CONV_KEYS = ("base_kernel", "kernel_projection.weight")
SELECTOR_KEYS = ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")


class DynamicBlockConv(nn.Module):
    """The grouped dynamic causal conv over block positions: `prepare` before a sublayer, `finish` after it."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.taps, self.group_size, self.block_size = cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * cfg.conv_groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(conv of x [R, Q, H] with the first kernel, the second kernel's dynamic part for `finish`)."""
        R, Q, H = x.shape
        dynamic = self.kernel_projection(x).view(R, Q, 2, self.taps, H // self.group_size)
        return self._conv(x, self.base_kernel[0], dynamic[:, :, 0]), dynamic[:, :, 1]

    def finish(self, y: Tensor, dynamic: Tensor) -> Tensor:
        return self._conv(y, self.base_kernel[1], dynamic)

    def _conv(self, x: Tensor, base: Tensor, dynamic: Tensor) -> Tensor:
        """sum over taps o of (base[o] + dynamic[t, o, group of c]) * x[t - o], zero where t - o leaves the block.

        Channels are viewed as [groups, group_size] so that a group's coefficient broadcasts over its channels: its
        gradient is then a plain sum over them (repeat_interleave's would be an index_add)."""
        R, Q, H = x.shape
        B, K, G = self.block_size, self.taps, H // self.group_size
        blocks = x.view(R, Q // B, B, G, self.group_size)
        dynamic = dynamic.view(R, Q // B, B, K, G, 1)
        base = base.view(K, G, self.group_size)
        out = blocks * (base[0] + dynamic[..., 0, :, :]).to(x.dtype)
        for o in range(1, K):  # tap o reads x[t - o]: only slots t >= o have one (no zero-padded copy of x)
            out[:, :, o:] += blocks[:, :, : B - o] * (base[o] + dynamic[:, :, o:, o]).to(x.dtype)
        return out.view(R, Q, H)


class DFlash2Layer(Layer):
    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.attention_conv = DynamicBlockConv(cfg)
        self.mlp_conv = DynamicBlockConv(cfg)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        y, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(y, ctx, q_rope, kv_rope, mask), dynamic)
        y, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(y), dynamic)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        nn.init.normal_(self.predecessor_codebook, std=INIT_STD)
        nn.init.normal_(self.hidden_projection.weight, std=INIT_STD)

    def lattice(self, hidden: Tensor, unary: Tensor, anchor: Tensor, candidates: Tensor) -> Tensor:
        """S [k, K, K] of a block's k slots at once: S[l, p, c] scores candidate c of slot l after candidate p of
        slot l - 1 (slot 0: after the anchor, every row the same). hidden [k, H], unary / candidates [k, K]. The
        pair terms are one batched [K, r] x [r, K] product a slot (edge_scores' per-row form would gather the
        successor rows K times over: [k, K, K, r])."""
        K = candidates.shape[1]
        previous = torch.cat([anchor.reshape(1, 1).expand(1, K), candidates[:-1]])  # [k, K]
        gate = self.predecessor_codebook[previous] * self.hidden_projection(hidden)[:, None, :]  # [k, K, r]
        pair = torch.einsum("lpr,lcr->lpc", gate, self.successor_codebook[candidates])
        return unary[:, None, :] + pair.to(unary.dtype)

    def edge_scores(self, hidden: Tensor, unary: Tensor, previous: Tensor, candidates: Tensor) -> Tensor:
        """S [N, K] = unary [N, K] + <A[previous] * (P hidden), B[candidates]> for hidden [N, H], previous [N]."""
        gate = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [N, r]
        pair = (gate[:, None, :] * self.successor_codebook[candidates]).sum(-1)
        return unary + pair.to(unary.dtype)


class DFlash2Drafter(DFlashDrafter):
    layer_cls = DFlash2Layer

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        for layer in self.layers:  # the backbone's init drew the projections: back to the identity
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()

    def forward(self, block_embeds, features, q_positions, ctx_positions, block_mask=None):
        scale = self.config.input_embedding_scale
        embeds = block_embeds if scale == 1.0 else block_embeds * scale
        return super().forward(embeds, features, q_positions, ctx_positions, block_mask)


class _CandidateLogits(torch.autograd.Function):
    """hidden [N, H] . head[candidates] [N, K, H] -> [N, K], without keeping the gathered rows for backward."""

    @staticmethod
    def forward(ctx, hidden, head, candidates):
        ctx.save_for_backward(hidden, head, candidates)
        rows = head[candidates].to(hidden.dtype)
        return torch.einsum("nh,nkh->nk", hidden, rows)

    @staticmethod
    def backward(ctx, grad):
        hidden, head, candidates = ctx.saved_tensors
        return torch.einsum("nk,nkh->nh", grad.to(hidden.dtype), head[candidates].to(hidden.dtype)), None, None


def candidate_logits(hidden: Tensor, head: Tensor, candidates: Tensor) -> Tensor:
    return _CandidateLogits.apply(hidden, head, candidates)


def selector_targets(candidates: Tensor, labels: Tensor, outside: str) -> tuple[Tensor, Tensor, Tensor]:
    """(candidates [N, K] the selector's CE scores, index [N] of the label among them, in_top [N] whether the
    label is among the LM head's top K). outside "replace": a label outside the top K takes the K-th candidate's
    place (speculators); "drop": the candidates stay, and such positions leave the CE (SpecForge)."""
    hits = candidates == labels[:, None]
    in_top = hits.any(dim=-1)
    if outside == "replace":
        last = torch.zeros_like(hits)
        last[:, -1] = True
        candidates = torch.where(last & ~in_top[:, None], labels[:, None], candidates)
        hits = candidates == labels[:, None]
    return candidates, hits.int().argmax(dim=-1), in_top


def objective(model, hidden, head, labels, weights, block_size, options, teacher=None) -> Objective:
    cfg = model.config
    if cfg.final_logit_softcapping is not None:
        raise DflashError("training a DFlash 2 drafter with final_logit_softcapping is not supported; leave it unset")
    previous = labels.roll(1)  # slot k's predecessor is the token at k - 1 (slot 1's: the anchor)
    hidden, labels, weights, previous = (drafted_slots(t, block_size) for t in (hidden, labels, weights, previous))
    if teacher:
        teacher = {name: drafted_slots(values, block_size) for name, values in teacher.items()}
    unary_hidden = hidden * cfg.output_multiplier if cfg.output_multiplier != 1.0 else hidden
    unary_total, unary_terms, w, top, top_teacher = _unary_loss(
        unary_hidden, head, labels, weights, block_size - 1, options, teacher, cfg.selector_top_k
    )
    candidates, target, in_top = selector_targets(top, labels, options.selector_outside)
    unary = candidate_logits(unary_hidden, head, candidates).to(acc_dtype(hidden.dtype))
    scores = model.candidate_selector.edge_scores(hidden, unary, previous, candidates)
    selector = scores.logsumexp(dim=-1) - scores.gather(1, target[:, None])[:, 0]
    if teacher:
        # p at each candidate: at the label where it is one (a label `replace` put in the K-th place included)
        teacher_at = torch.where(candidates == labels[:, None], top_teacher[:, -1:], top_teacher[:, :-1])
        distance = selector_distance(scores, teacher_at)
        selector = CE_WEIGHT * selector + DISTANCE_WEIGHT * distance  # DSpark's weights, as the unary term's
    kept = in_top if options.selector_outside == "drop" else torch.ones_like(in_top)
    selector_terms = options.selector_weight * w * kept * selector
    terms = (unary_terms + selector_terms).detach()
    correct = in_top & (scores.argmax(dim=-1) == target)
    return Objective(unary_total + selector_terms.sum(), with_slot0(terms, block_size), with_slot0(correct, block_size))


def _unary_loss(hidden, head, labels, weights, span, options, teacher, top_k):
    """The unary logits' loss: (its differentiable sum, its terms [N], the position weights w [N], the top_k
    candidates [N, K], with a teacher the target's p [N, K + 1] at them and at the label); the block CE, or with a
    teacher 0.1 CE + 0.9 L1 to the target's distribution."""
    if not teacher:
        ce, _, top = loss.head_cross_entropy(hidden, head, labels, options.loss_chunk, top_k)
        w = loss.position_weights(options.position_weights, ce, weights, span)
        return (w * ce).sum(), w * ce, w, top, None
    no_markov = hidden[:, :0], head[:, :0]  # e and W2 of width 0: the plain LM head's logits
    kind, chunk = options.position_weights, options.loss_chunk
    got = teacher_head_loss(
        hidden, no_markov[0], head, no_markov[1], labels, weights, teacher, kind, span, chunk, top_k=top_k
    )
    return got.total, got.terms, got.weight, got.top, got.top_teacher


def selector_distance(scores: Tensor, teacher_probs: Tensor) -> Tensor:
    """L1 [N] between the selector's K-way q = softmax(S) and the target's p over the K candidates and the rest as
    one outcome (where q is 0): 2 (1 - sum_c min(p_c, q_c)), twice the chance that verification at T = 1 rejects a
    draft sampled from q. teacher_probs [N, K]: p at each candidate (0 where the teacher does not know it)."""
    q = torch.softmax(scores, dim=-1)
    return (q - teacher_probs).abs().sum(-1) + (1 - teacher_probs.sum(-1)).clamp_min(0)


class DFlash2Proposer(DFlashProposer):
    """Walks the block left to right through the candidate selector (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_block = self.device_part(self._draft_block)

    def choose(self, hidden: Tensor, anchor: Tensor, temperature: float, generator) -> Draft:
        draws = uniforms(hidden.shape[0], temperature, generator, hidden.device)
        # The target's LM head runs outside the compiled part: under tensor parallelism it is a sharded module.
        unary = self.head(hidden * self.config.output_multiplier)
        return Draft(*self.draft_block(hidden, unary, anchor, draws, temperature))

    def _draft_block(self, hidden: Tensor, unary: Tensor, anchor: Tensor, draws: Tensor | None, temperature: float):
        """(the drafts [k], at T > 0 their K-way q [k, V] as float32, 0 off the candidates), all on the device."""
        cfg = self.config
        unary = unary.to(acc_dtype(hidden.dtype))
        if cfg.final_logit_softcapping is not None:
            unary = cfg.final_logit_softcapping * torch.tanh(unary / cfg.final_logit_softcapping)
        values, candidates = vocab_top_k(unary, cfg.selector_top_k)  # the top-K the trainer takes
        lattice = self.drafter.candidate_selector.lattice(hidden, values, anchor, candidates).float()
        picks, probs = walk(lattice, draws, temperature)
        tokens = candidates.gather(1, picks[:, None])[:, 0]
        if probs is None:
            return tokens, None
        return tokens, torch.zeros_like(unary, dtype=torch.float32).scatter_(1, candidates, probs.float())


def walk(lattice: Tensor, draws: Tensor | None, temperature: float) -> tuple[Tensor, Tensor | None]:
    """The left-to-right walk over a block's lattice [k, K, K]: (the candidate index picked at each slot [k], and at
    T > 0 the K-way q [k, K] (float64) each was drawn from). Slot 0's rows all hold the anchor; each next row is the
    candidate picked at the slot before. Greedy takes the best edge; at T > 0 slot l samples softmax(S / T) by
    inverse_cdf at draws[l].

    A slot's pick depends on its predecessor only through the lattice row it reads, so every slot's pick is made for
    each of its K possible predecessors at once ([k, K] choices, one uniform per slot as in a sequential walk: the
    same draws), and the chain only follows the predecessor actually picked: k gathers of one index are all that is
    sequential. Nothing leaves the device, so the round's drafting has no host sync."""
    if draws is None:
        q, choices = None, lattice.argmax(dim=-1)
    else:
        q = torch.softmax(lattice.double() / temperature, dim=-1)
        choices = inverse_cdf(q, draws[:, None, None])
    row, picks, previous = choices.new_zeros(1), [], []
    for slot in range(lattice.shape[0]):
        previous.append(row)
        row = choices[slot].gather(0, row)  # a gather: no data-dependent index
        picks.append(row)
    picks, previous = torch.cat(picks), torch.cat(previous)
    if q is None:
        return picks, None
    return picks, q.gather(1, previous.view(-1, 1, 1).expand(-1, 1, q.shape[-1]))[:, 0]


METHOD = Method(
    name="dflash2",
    config_cls=DFlash2Config,
    model_cls=DFlash2Drafter,
    proposer_cls=DFlash2Proposer,
    objective_fn=objective,
    teacher="optional",
)
