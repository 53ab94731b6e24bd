"""Speculative decoding of one prompt against a transformers target: draft acceptance, the target's cache, the
decoding loops (speculative and plain greedy) and the proposers (a DFlash drafter, prompt lookup).

Bookkeeping of one generation (batch size 1):
- *committed* tokens are the prompt plus every token the target has vouched for;
- the target's cache holds the first `cached` committed tokens; the rest, the *pending* tokens (at least the
  last committed one), are fed at the head of the next verify forward;
- the drafter sees the target features of every committed token but the last, which starts its block
  `[last committed, MASK x (B-1)]` at the next absolute positions.

A round drafts k tokens, verifies `pending + drafts` in one target forward, keeps the longest accepted prefix
plus the target's bonus token, then puts the cache back in step with the committed tokens:
- dense targets: the rejected drafts' keys and values are cropped off;
- hybrid Gated-DeltaNet targets: a recurrent state cannot be cropped, so the linear layers' conv and
  recurrent states are snapshotted before the verify forward; on a rejection they are restored and the
  attention caches cropped back to the same length, and the accepted tokens stay pending: the next verify
  forward feeds them again ahead of its drafts, which recomputes the states in the forward the round needs
  anyway (no extra target forward).

A generation records the drafts each round accepted, cut at EOS; dflash.evaluate turns them into tau.
"""

import inspect
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from dflash.drafter.proposers import Draft, Proposer, draw
from dflash.errors import DflashError

# ---------------------------------------------------------------------------------------------------------------
# Acceptance of drafts
# ---------------------------------------------------------------------------------------------------------------


def accept_greedy(draft: Draft, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix where the draft equals the target's argmax, and the target's token after it (one host sync)."""
    choices = target_logits.argmax(-1)
    k = draft.tokens.numel()
    accepted = (draft.tokens == choices[:k]).to(choices.dtype).cumprod(0).sum()
    accepted, bonus = torch.stack([accepted, choices[accepted]]).tolist()
    return accepted, bonus


def target_probs(target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target's sampling distribution p [rows, V] at `temperature` > 0, computed once per round: verification
    and the acceptance diagnostics both read it."""
    return torch.softmax(target_logits.float() / temperature, dim=-1)


def accept_sampled(draft: Draft, p: torch.Tensor, generator=None) -> tuple[int, int]:
    """Speculative sampling against the target's p [k + 1, V] (target_probs): keep token i with probability
    min(1, p_i/q_i); on the first rejection draw from the residual max(0, p - q) renormalised, else draw the bonus
    from p after the last draft. The committed tokens are then distributed exactly as sampling the target alone.
    Every step stays on the device; the one host sync reads (accepted, bonus) together."""
    k = draft.tokens.numel()
    q = draft.probs if draft.probs is not None else F.one_hot(draft.tokens, p.shape[-1]).float()
    rows = torch.arange(k, device=p.device)
    p_token, q_token = p[rows, draft.tokens], q[rows, draft.tokens]
    uniform = torch.rand(k, device=p.device, generator=generator)
    accepted = (uniform * q_token < p_token).int().cumprod(0).sum()
    # Row i < k: the residual after rejecting draft i; row k: p itself, the bonus after k accepted drafts.
    residuals = torch.cat([(p[:k] - q).clamp_min(0), p[k:]])
    residual = residuals[accepted]
    # The residual is zero only when p == q at that position, where a rejection has probability 0 anyway.
    residual = torch.where(residual.sum() > 0, residual, p[accepted])
    bonus = torch.multinomial(residual, 1, generator=generator)[0]
    accepted, bonus = torch.stack([accepted.to(bonus.dtype), bonus]).tolist()
    return accepted, bonus


def draft_overlap(draft: Draft, p: torch.Tensor) -> torch.Tensor:
    """[k, 3] per drafted position i, from the target's p (target_probs, rows 0 .. k-1 read):
    - sum_v min(p_i(v), q_i(v)), the chance that speculative sampling accepts draft i given the drafts before it
      (the target's p_i is conditioned on them);
    - p_i's mass on q_i's support S, which caps it: a K-way q (DFlash 2's) can never be accepted more often than
      the target puts mass on its K candidates;
    - q_i's fit to p_i within S, sum_{v in S} min(p_i(v) / p_i(S), q_i(v)) = 1 - TV(q_i, p_i renormalised on S):
      1 when q is p's shape there. The acceptance is at least the product of the last two, so a low acceptance
      under a high cap is q's shape, not its support."""
    k = draft.tokens.numel()
    p = p[:k]
    if draft.probs is None:  # a point mass on each draft
        mass = p.gather(1, draft.tokens[:, None])
        return torch.cat([mass, mass, torch.ones_like(mass)], dim=1)
    q = draft.probs.float()
    on_support = p * (q > 0)
    support = on_support.sum(-1)
    shape = torch.minimum(on_support / support[:, None], q).sum(-1)
    return torch.stack([torch.minimum(p, q).sum(-1), support, shape], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The target's cache: snapshot, restore, crop
# ---------------------------------------------------------------------------------------------------------------


def is_stateful(cache: DynamicCache) -> bool:
    """Whether the cache holds recurrent/conv states that cannot be cropped back to a shorter prefix."""
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def check_cache_supported(cache: DynamicCache) -> None:
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, LinearAttentionLayer):
            raise DflashError(
                f"speculative decoding does not support the target's cache layer {type(layer).__name__}; "
                "supported: full attention (DynamicLayer) and Gated-DeltaNet linear attention (LinearAttentionLayer)"
            )


def crop_attention(cache: DynamicCache, length: int) -> None:
    """Cut every attention layer's keys and values back to the first `length` tokens."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            DynamicLayer.crop(layer, -(layer.get_seq_length() - length))


class LinearStates:
    """Copies of every linear-attention layer's conv and recurrent states, to undo a verify forward."""

    def __init__(self, cache: DynamicCache):
        self.saved = [
            (layer, _clone_states(layer.conv_states), _clone_states(layer.recurrent_states))
            for layer in cache.layers
            if isinstance(layer, LinearAttentionCacheLayerMixin)
        ]

    def restore(self) -> None:
        # Assign the copies rather than copy into the live tensors: the copies are not used again.
        for layer, conv, recurrent in self.saved:
            layer.conv_states.update(conv)
            layer.recurrent_states.update(recurrent)


def _clone_states(states: dict) -> dict:
    return {i: state.clone() for i, state in states.items() if state is not None}


# ---------------------------------------------------------------------------------------------------------------
# Decoding loops
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]  # new tokens, ending at the first EOS (kept) or at max_new_tokens
    seconds: float
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round (speculative only)
    # per round, draft_overlap's [overlap, support mass, shape] of the drafts verification reached (the accepted
    # ones and the first rejected one); speculative sampling only
    overlaps: list[list[list[float]]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-2 logit gap per step (plain greedy only)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _features(hidden_states, layer_ids: list[int], rows: slice) -> torch.Tensor:
    """Concatenated outputs of the tapped layers (layer k's output is hidden_states[k + 1]) for `rows`."""
    return torch.cat([hidden_states[k + 1][0, rows] for k in layer_ids], dim=-1)


def _stop_index(tokens: list[int], eos_ids: set[int]) -> int | None:
    return next((i for i, token in enumerate(tokens) if token in eos_ids), None)


def cache_argument(target) -> str:
    """The name of the forward's cache argument: `past_key_values`, renamed `cache` in later transformers 5 releases
    (the old name is deprecated there, to go in 5.40)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


class SpeculativeState:
    """One generation's committed tokens, target cache and features; `round` runs one draft-verify step."""

    def __init__(self, target, prompt: torch.Tensor, layer_ids: list[int], capacity: int):
        self.target = target
        self.layer_ids = layer_ids
        self.cache = DynamicCache(config=target.config)
        self.cache_name = cache_argument(target)
        self.committed = prompt
        self.cached = 0
        self.stateful = False  # set from the cache's layers once the prefill has built them
        self.features = None
        self.capacity = capacity
        self.overlaps = []  # draft_overlap per round at temperature > 0

    def prefill(self) -> torch.Tensor:
        """Run the prompt through the target; returns the logits for the first new token."""
        out = self._forward(self.committed, logits_to_keep=1)
        check_cache_supported(self.cache)
        self.stateful = is_stateful(self.cache)
        self.cached = self.committed.numel()
        if self.layer_ids:
            rows = _features(out.hidden_states, self.layer_ids, slice(None))
            self.features = rows.new_empty(self.capacity, rows.shape[-1])
            self.features[: rows.shape[0]] = rows
        return out.logits[0, -1]

    def commit(self, tokens: list[int]) -> None:
        new = torch.tensor(tokens, dtype=self.committed.dtype, device=self.committed.device)
        self.committed = torch.cat([self.committed, new])

    def round(self, proposer: Proposer, num_drafts: int, temperature: float, generator) -> tuple[int, list[int]]:
        """Draft up to `num_drafts` tokens and verify them; returns (accepted drafts, committed tokens)."""
        n = self.committed.numel()
        context = self.features[: n - 1] if self.features is not None else None
        draft = proposer.propose(self.committed, context, num_drafts, temperature, generator)
        k = draft.tokens.numel()
        pending = self.committed[self.cached :]
        snapshot = LinearStates(self.cache) if self.stateful and k > 0 else None
        out = self._forward(torch.cat([pending, draft.tokens]), logits_to_keep=k + 1)
        if temperature == 0:
            accepted, bonus = accept_greedy(draft, out.logits[0])
        else:
            p = target_probs(out.logits[0], temperature)
            accepted, bonus = accept_sampled(draft, p, generator)
            if k > 0:  # on the device until the generation ends: no sync here
                self.overlaps.append(draft_overlap(draft, p)[: accepted + 1])
        if self.features is not None:
            # Rows of the last pending token and the accepted drafts: committed positions n-1 .. n-1+accepted.
            first = pending.numel() - 1
            self.features[n - 1 : n + accepted] = _features(
                out.hidden_states, self.layer_ids, slice(first, first + accepted + 1)
            )
        self._resync_cache(pending.numel(), k, accepted, snapshot)
        new_tokens = draft.tokens[:accepted].tolist() + [bonus]
        self.commit(new_tokens)
        return accepted, new_tokens

    def _resync_cache(self, num_pending: int, k: int, accepted: int, snapshot: LinearStates | None) -> None:
        if accepted == k:
            self.cached += num_pending + k
        elif snapshot is None:
            self.cached += num_pending + accepted
            crop_attention(self.cache, self.cached)
        else:
            # Back to the state before this forward; the accepted tokens stay pending (see the module docstring).
            snapshot.restore()
            crop_attention(self.cache, self.cached)

    def _forward(self, tokens: torch.Tensor, logits_to_keep: int):
        return self.target(
            tokens[None],
            **{self.cache_name: self.cache},
            use_cache=True,
            output_hidden_states=bool(self.layer_ids),
            logits_to_keep=logits_to_keep,
        )


@torch.inference_mode()
def speculative_generate(
    target,
    proposer: Proposer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    max_drafts: int = 15,
) -> Generation:
    """Speculative decoding of one prompt (1-D token ids on the target's device)."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    state = SpeculativeState(target, prompt, proposer.layer_ids, prompt.numel() + max_new_tokens + max_drafts + 1)
    first = int(draw(state.prefill()[None], temperature, generator).tokens[0])
    state.commit([first])
    tokens, accepted = [first], []
    while first not in eos_ids and len(tokens) < max_new_tokens:
        # Never draft past max_new_tokens: the bonus token fills the last slot.
        room = max_new_tokens - len(tokens)
        num_accepted, new = state.round(proposer, min(max_drafts, room - 1), temperature, generator)
        stop = _stop_index(new, eos_ids)
        if stop is not None:
            new = new[: stop + 1]
            num_accepted = min(num_accepted, stop)
        tokens += new
        accepted.append(num_accepted)
        if stop is not None:
            break
    _sync(device)
    seconds = time.perf_counter() - start
    overlaps = [o.tolist() for o in state.overlaps[: len(accepted)]]  # rounds past an EOS cut were never made
    return Generation(tokens, seconds, accepted=accepted, overlaps=overlaps)


@torch.inference_mode()
def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """The baseline at temperature 0: greedy decoding with the target's KV cache, one forward per token."""
    return plain_decode(target, prompt, max_new_tokens, eos_ids)


def plain_decode(
    target,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Generation:
    """The baseline: decoding with the target's KV cache, one forward per token, greedy at temperature 0 and
    sampled at `temperature` otherwise (as speculative sampling draws, `draw`)."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    cache = {cache_argument(target): DynamicCache(config=target.config)}
    tokens, top2 = [], []
    step_input = prompt
    while len(tokens) < max_new_tokens:
        logits = target(step_input[None], **cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        top2.append(logits.float().topk(2).values)  # kept on device: no extra sync inside the timed loop
        token = int(logits.argmax()) if temperature == 0 else int(draw(logits[None], temperature, generator).tokens[0])
        tokens.append(token)
        if token in eos_ids:
            break
        step_input = torch.tensor([token], device=device)
    _sync(device)
    seconds = time.perf_counter() - start
    margins = (torch.stack(top2)[:, 0] - torch.stack(top2)[:, 1]).tolist()
    return Generation(tokens, seconds, margins=margins)


# ---------------------------------------------------------------------------------------------------------------
# transformers' prompt lookup, for comparison
# ---------------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def generate_prompt_lookup(
    target, prompt: torch.Tensor, max_new_tokens: int, num_tokens: int
) -> tuple[Generation, int]:
    """transformers' own prompt-lookup decoding (dense targets only), with the number of target forwards it ran.

    Its first forward verifies the prompt and the first candidates together, so its tau is
    new tokens / target forwards."""
    forwards = 0

    def count(*_):
        nonlocal forwards
        forwards += 1

    hook = target.register_forward_pre_hook(count)
    device = prompt.device
    try:
        _sync(device)
        start = time.perf_counter()
        out = target.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            prompt_lookup_num_tokens=num_tokens,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        _sync(device)
    finally:
        hook.remove()
    return Generation(out[0, prompt.numel() :].tolist(), time.perf_counter() - start), forwards
