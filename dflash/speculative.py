"""Speculative decoding against a transformers target, with a DFlash drafter or prompt lookup, and its metrics.

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

Acceptance length tau = mean over rounds of the tokens a round commits (accepted drafts + the bonus token),
cut at EOS like the public DFlash benchmark; the first token, from the prefill, belongs to no round, so
`tau = (new tokens - 1) / rounds`.
"""

import hashlib
import inspect
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from dflash.errors import DflashError, describe_differences
from dflash.target import DTYPES, GPU_EXTRA, MASK_TOKEN, describe_kernels, select_kernels

logger = logging.getLogger("dflash")


# ---------------------------------------------------------------------------------------------------------------
# Drafts and their verification
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] proposed continuation of the committed tokens
    probs: torch.Tensor | None = None  # [k, V] distribution q each token was sampled from; None = a point mass


class Proposer(Protocol):
    """Anything that drafts tokens: the DFlash drafter, prompt lookup, test stubs."""

    layer_ids: list[int]  # target layers whose outputs it needs as features ([] = none)

    def propose(
        self, committed: torch.Tensor, features: torch.Tensor, num_tokens: int, temperature: float, generator
    ) -> Draft: ...


def draw(logits: torch.Tensor, temperature: float, generator=None) -> Draft:
    """Pick one token per row of `logits` [k, V]: argmax at temperature 0, else a sample kept with its q."""
    if temperature == 0:
        return Draft(logits.argmax(-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return Draft(torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs)


def accept_greedy(draft: Draft, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix where the draft equals the target's argmax, and the target's token after it."""
    choices = target_logits.argmax(-1)
    k = draft.tokens.numel()
    accepted = int((draft.tokens == choices[:k]).int().cumprod(0).sum())
    return accepted, int(choices[accepted])


def accept_sampled(draft: Draft, target_logits: torch.Tensor, temperature: float, generator=None) -> tuple[int, int]:
    """Speculative sampling: keep token i with probability min(1, p_i/q_i); on the first rejection draw from
    the residual max(0, p - q) renormalised, else draw the bonus from p after the last draft. The committed
    tokens are then distributed exactly as sampling the target alone."""
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    k = draft.tokens.numel()
    q = draft.probs if draft.probs is not None else F.one_hot(draft.tokens, p.shape[-1]).float()
    rows = torch.arange(k, device=p.device)
    p_token, q_token = p[rows, draft.tokens], q[rows, draft.tokens]
    uniform = torch.rand(k, device=p.device, generator=generator)
    accepted = int((uniform * q_token < p_token).int().cumprod(0).sum())
    if accepted == k:
        residual = p[k]
    else:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        # Zero only when p == q at that position, where a rejection has probability 0 anyway.
        residual = residual if residual.sum() > 0 else p[accepted]
    return accepted, int(torch.multinomial(residual, 1, generator=generator))


def verify(draft: Draft, target_logits: torch.Tensor, temperature: float, generator=None) -> tuple[int, int]:
    if temperature == 0:
        return accept_greedy(draft, target_logits)
    return accept_sampled(draft, target_logits, temperature, generator)


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
        accepted, bonus = verify(draft, out.logits[0].float(), temperature, generator)
        if self.features is not None:
            # Rows of the last pending token and the accepted drafts: committed positions n-1 .. n-1+accepted.
            first = pending.numel() - 1
            self.features[n - 1 : n + accepted] = _features(out.hidden_states, self.layer_ids, slice(first, first + accepted + 1))
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
    return Generation(tokens, time.perf_counter() - start, accepted=accepted)


@torch.inference_mode()
def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """The baseline: greedy decoding with the target's KV cache, one forward per token."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    cache = {cache_argument(target): DynamicCache(config=target.config)}
    tokens, top2 = [], []
    step_input = prompt
    while len(tokens) < max_new_tokens:
        logits = target(step_input[None], **cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        top2.append(logits.float().topk(2).values)  # kept on device: no extra sync inside the timed loop
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos_ids:
            break
        step_input = torch.tensor([token], device=device)
    _sync(device)
    seconds = time.perf_counter() - start
    margins = (torch.stack(top2)[:, 0] - torch.stack(top2)[:, 1]).tolist()
    return Generation(tokens, seconds, margins=margins)


# ---------------------------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------------------------


class DFlashProposer:
    """Drafts with a DFlash drafter through the target's own embeddings and LM head."""

    def __init__(self, drafter, config, target):
        self.drafter = drafter
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.layer_ids = list(config.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()

    def propose(self, committed, features, num_tokens, temperature, generator) -> Draft:
        if num_tokens == 0:
            return Draft(committed.new_empty(0))
        n, device = committed.numel(), committed.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=committed.dtype, device=device)
        block[0, 0] = committed[-1]
        q_positions = torch.arange(n - 1, n - 1 + self.block_size, device=device)[None]
        ctx_positions = torch.arange(n - 1, device=device)[None]
        hidden = self.drafter(self.embed(block), features[None], q_positions, ctx_positions)
        # Block slot 0 holds the known token; slots 1.. predict the tokens after it.
        logits = self.head(hidden[0, 1 : 1 + num_tokens])
        return draw(logits, temperature, generator)


class PromptLookupProposer:
    """Prompt-lookup drafts from transformers' own n-gram matcher (`PromptLookupCandidateGenerator`), verified
    by our loop: transformers' `generate(prompt_lookup_num_tokens=...)` refuses stateful (hybrid) targets."""

    layer_ids: list[int] = []

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2, eos_ids: Sequence[int] = ()):
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self.matcher = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(sorted(eos_ids)) if eos_ids else None,
            num_output_tokens=num_tokens,
            max_matching_ngram_size=max_ngram,
            max_length=2**62,  # our loop caps the draft length itself
        )

    def propose(self, committed, features, num_tokens, temperature, generator) -> Draft:
        if self.matcher.eos_token_id is not None:
            self.matcher.eos_token_id = self.matcher.eos_token_id.to(committed.device)
        candidates, _ = self.matcher.get_candidates(committed[None])
        return Draft(candidates[0, committed.numel() :][:num_tokens])


@torch.inference_mode()
def generate_prompt_lookup(target, prompt: torch.Tensor, max_new_tokens: int, num_tokens: int) -> tuple[Generation, int]:
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


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DflashError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_target(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32"):
    """The full target (with LM head) for generation, frozen, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise DflashError(f"{path} is not a model folder (no config.json); pass the target's local folder")
    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    kernels = select_kernels(model, device, allow_slow=True, generation=True)
    model = model.to(device).eval()
    model.requires_grad_(False)
    logger.info("target %s on %s; kernels: %s", path, device, describe_kernels(kernels))
    # The convolutions' reference code is a small op: the delta rules are the ones that cost.
    slow = [role for role in ("gated_delta_rule", "recurrent_gated_delta_rule")
            if device.type == "cuda" and kernels.get(role) == "torch-reference"]  # fmt: skip
    if slow:
        logger.warning("the target's %s run on PyTorch reference code on the GPU: correct but slow; run %s for the "
                       "fast kernels", " and ".join(slow), GPU_EXTRA)  # fmt: skip
    return model, AutoTokenizer.from_pretrained(path)


def untrained_drafter(target, tokenizer, block_size: int = 16, seed: int = 0, mask_token_id: int | None = None):
    """A randomly initialised drafter shaped from the target's config: the baseline a trained one must beat."""
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.target import default_layer_ids

    if mask_token_id is None:
        mask_token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
            raise DflashError(f"the target's tokenizer has no {MASK_TOKEN} token; pass a mask token id")
    config = DrafterConfig.from_target_config(
        target.config,
        target_layer_ids=default_layer_ids(target.config.get_text_config(decoder=True).num_hidden_layers),
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).to(device=target.device, dtype=target.dtype).eval()
    return drafter, config


def _drafter_and_config(drafter, target, tokenizer, block_size: int, seed: int):
    """`drafter` is a folder, "untrained", or a (model, config) pair already in memory."""
    if isinstance(drafter, tuple):
        return drafter
    if drafter == "untrained":
        return untrained_drafter(target, tokenizer, block_size, seed)
    from dflash.drafter import load_drafter

    model, config = load_drafter(drafter, target.device, target.dtype)
    return model.eval(), config


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One method on one prompt."""

    new_tokens: int
    seconds: float
    rounds: int  # verify forwards after the prefill (speculative); target forwards (prompt-lookup-generate)
    tau: float | None
    accepted: list[int]  # accepted drafts per round ([] when not observable)
    mismatch_at: int | None = None  # temperature 0: first position differing from plain greedy decoding
    plain_margin_at_mismatch: float | None = None  # the plain target's top-2 logit gap there (tiny = a numerical tie)


@dataclass
class Method:
    """One method over all prompts."""

    name: str
    tau: float | None
    tau_definition: str
    accepted_histogram: list[int]  # [i] = rounds that accepted exactly i drafts
    rounds: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # its tokens/s over plain greedy decoding's, measured in the same run
    mismatches: int | None  # temperature 0: prompts whose output differs from plain greedy decoding
    first_mismatch: dict | None


@dataclass
class EvalReport:
    target: str
    drafter: str | None
    temperature: float
    max_new_tokens: int
    device: str
    dtype: str
    prompt_lookup_tokens: int
    block_size: int  # of the untrained drafter
    seed: int
    plain_tokens_per_s: float
    methods: dict[str, Method]
    prompts: list[dict]  # per prompt: index, prompt_tokens, prompt_sha256, plain {new_tokens, seconds}, runs {method: Run}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        lines = [
            f"target {self.target}  drafter {self.drafter}  temperature {self.temperature}  "
            f"max_new_tokens {self.max_new_tokens}  {self.device} {self.dtype}  prompts {len(self.prompts)}",
            f"{'method':<22}{'tau':>7}{'tokens/s':>11}{'speedup':>9}{'mismatches':>12}  accepted drafts per round (0, 1, ...)",
            f"{'plain greedy':<22}{'-':>7}{self.plain_tokens_per_s:>11.1f}{'1.00x':>9}{'-':>12}",
        ]
        for m in self.methods.values():
            tau = f"{m.tau:.2f}" if m.tau is not None else "-"
            mismatches = "-" if m.mismatches is None else str(m.mismatches)
            histogram = " ".join(map(str, m.accepted_histogram)) or "-"
            lines.append(f"{m.name:<22}{tau:>7}{m.tokens_per_s:>11.1f}{m.speedup:>8.2f}x{mismatches:>12}  {histogram}")
        for m in self.methods.values():
            if m.first_mismatch:
                lines.append(f"{m.name}: first mismatch {m.first_mismatch}")
        return "\n".join(lines)

    def prompt_table(self) -> str:
        """A row per prompt: its plain decoding, then each method's tau and speedup (`!` marks a mismatch)."""
        names = list(self.methods)
        lines = [f"{'prompt':>6}{'tokens':>8}{'plain tok/s':>13}" + "".join(f"{n + ' tau, speedup':>34}" for n in names)]
        for row in self.prompts:
            plain = row["plain"]
            plain_rate = plain["new_tokens"] / plain["seconds"] if plain["seconds"] else 0.0
            cells = []
            for name in names:
                run = row["runs"][name]
                rate = run.new_tokens / run.seconds if run.seconds else 0.0
                tau = f"{run.tau:.2f}" if run.tau is not None else "-"
                mark = "!" if run.mismatch_at is not None else ""
                cells.append(f"{tau + mark:>26}{rate / plain_rate if plain_rate else 0.0:>7.2f}x")
            lines.append(f"{row['index']:>6}{plain['new_tokens']:>8}{plain_rate:>13.1f}" + "".join(cells))
        return "\n".join(lines)


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _compare(run: Run, tokens: list[int], plain: Generation) -> Run:
    run.mismatch_at = first_difference(tokens, plain.tokens)
    if run.mismatch_at is not None and run.mismatch_at < len(plain.margins):
        run.plain_margin_at_mismatch = plain.margins[run.mismatch_at]
    return run


# ---------------------------------------------------------------------------------------------------------------
# Methods compared against plain greedy decoding
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeMethod:
    """Our draft-verify loop with a proposer."""

    proposer: Proposer
    max_drafts: int
    temperature: float
    tau_definition = (
        "mean over verify rounds of (accepted drafts + 1 bonus token), cut at EOS; "
        "the prefill's first token belongs to no round"
    )

    @property
    def checks_greedy(self) -> bool:
        return self.temperature == 0

    def run(self, target, prompt, budget, plain: Generation, eos_ids, generator) -> Run:
        generation = speculative_generate(
            target, self.proposer, prompt, budget, eos_ids, self.temperature, generator, self.max_drafts
        )
        accepted = generation.accepted
        run = Run(len(generation.tokens), generation.seconds, len(accepted), _tau(accepted), accepted)
        return _compare(run, generation.tokens, plain) if self.checks_greedy else run

    @staticmethod
    def overall_tau(runs: list[Run]) -> float | None:
        return _tau([a for r in runs for a in r.accepted])


def _tau(accepted: list[int]) -> float | None:
    """Mean tokens committed per verify round: the accepted drafts plus the bonus token."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else None


@dataclass
class GenerateLookupMethod:
    """transformers' own greedy prompt-lookup decoding (dense targets), tau from its forward count."""

    num_tokens: int
    tau_definition = (
        "new tokens / target forwards of transformers generate(prompt_lookup_num_tokens); "
        "its first forward verifies the prompt and the first candidates together"
    )
    checks_greedy = True

    def run(self, target, prompt, budget, plain: Generation, eos_ids, generator) -> Run:
        generation, forwards = generate_prompt_lookup(target, prompt, budget, self.num_tokens)
        tokens = generation.tokens
        run = Run(len(tokens), generation.seconds, forwards, len(tokens) / forwards if forwards else None, [])
        return _compare(run, tokens, plain)

    @staticmethod
    def overall_tau(runs: list[Run]) -> float | None:
        forwards = sum(r.rounds for r in runs)
        return sum(r.new_tokens for r in runs) / forwards if forwards else None


def _summarise(name: str, method, rows: list[dict], plain_tokens_per_s: float) -> Method:
    """One method over the prompt rows (in prompt order) of a report."""
    runs = [row["runs"][name] for row in rows]
    new_tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    accepted = [a for r in runs for a in r.accepted]
    tokens_per_s = new_tokens / seconds if seconds else 0.0
    mismatched = [(row["index"], row["runs"][name]) for row in rows if row["runs"][name].mismatch_at is not None]
    first = None
    if mismatched:
        i, r = mismatched[0]
        first = {"prompt": i, "position": r.mismatch_at, "plain_margin": r.plain_margin_at_mismatch}
    return Method(
        name=name,
        tau=method.overall_tau(runs),
        tau_definition=method.tau_definition,
        accepted_histogram=[accepted.count(i) for i in range(max(accepted) + 1)] if accepted else [],
        rounds=sum(r.rounds for r in runs),
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=tokens_per_s,
        speedup=tokens_per_s / plain_tokens_per_s if plain_tokens_per_s else 0.0,
        mismatches=len(mismatched) if method.checks_greedy else None,
        first_mismatch=first,
    )


# ---------------------------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------------------------


def evaluate(
    target_path: str | Path,
    drafter,
    prompts: str | Path | list[dict],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    device: str = "auto",
    dtype: str = "auto",
    prompt_lookup_tokens: int = 10,
    block_size: int = 16,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = False,
    time_budget: float | None = None,
    min_prompts: int = 1,
    on_prompt=None,
    resume: dict | None = None,
) -> EvalReport:
    """Plain greedy decoding, then each method, prompt by prompt; tokens/s and speedups compare measurements of the
    same process (or, resumed, of the runs that made the report: same settings and device), and plain greedy is
    every method's reference.

    `drafter`: an exported drafter folder, "untrained" (random init from the target's config with
    `block_size`, the baseline), a `(model, config)` pair, None (prompt lookup only), or a list of these.
    `prompt_lookup_tokens`: prompt lookup's draft length (0 = skip it). `prompts`: a JSONL path or a list of
    records as a prompt file holds them. `time_budget`: seconds after which no further prompt is started (at least
    `min_prompts` run). `on_prompt(report)`: called after each prompt with the report so far (to save it).
    `resume`: an earlier, partial report of this evaluation as JSON (`EvalReport.to_json`): its prompts are not
    run again and count in the totals, so that a long eval can be spread over several runs.
    """
    from tqdm import tqdm

    from dflash.regenerate import encode_prompt, eos_token_ids, load_prompts, prompt_records

    target, tokenizer = load_target(target_path, device, dtype)
    eos_ids = eos_token_ids(target, tokenizer)
    records = load_prompts(prompts) if isinstance(prompts, (str, Path)) else prompt_records(prompts)
    encoded = [torch.tensor(encode_prompt(tokenizer, r), device=target.device) for r in records]
    drafters = drafter if isinstance(drafter, list) else [] if drafter is None else [drafter]
    methods = _methods(target, tokenizer, drafters, temperature, prompt_lookup_tokens, block_size, seed, eos_ids)
    generator = torch.Generator(target.device).manual_seed(seed)

    def report(rows: list[dict]) -> EvalReport:
        plain_tokens = sum(row["plain"]["new_tokens"] for row in rows)
        plain_seconds = sum(row["plain"]["seconds"] for row in rows)
        plain_tokens_per_s = plain_tokens / plain_seconds if plain_seconds else 0.0
        return EvalReport(
            target=str(target_path),
            drafter=", ".join(_drafter_label(d) for d in drafters) or None,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            prompt_lookup_tokens=prompt_lookup_tokens,
            block_size=block_size,
            seed=seed,
            plain_tokens_per_s=plain_tokens_per_s,
            methods={name: _summarise(name, method, rows, plain_tokens_per_s) for name, method in methods.items()},
            prompts=rows,
        )

    def in_order(rows: list[dict]) -> list[dict]:
        return sorted(rows, key=lambda row: row["index"])

    def run_all(prompt: torch.Tensor, budget: int) -> tuple[Generation, dict[str, Run]]:
        plain = plain_greedy(target, prompt, budget, eos_ids)
        return plain, {name: m.run(target, prompt, budget, plain, eos_ids, generator) for name, m in methods.items()}

    rows = _resumed_rows(resume, report([]), encoded) if resume else []
    done = {row["index"] for row in rows}
    todo = [i for i in range(len(encoded)) if i not in done]
    if warmup and todo:
        # First calls pay for allocations and kernel selection: keep them out of the timings.
        run_all(encoded[todo[0]], min(max_new_tokens, 8))
    start, ran = time.perf_counter(), 0
    for index in tqdm(todo, desc="eval", unit="prompt", disable=not progress):
        if time_budget is not None and ran >= min_prompts and time.perf_counter() - start > time_budget:
            break
        plain, runs = run_all(encoded[index], max_new_tokens)
        plain_summary = {"new_tokens": len(plain.tokens), "seconds": plain.seconds}
        identity = {"prompt_tokens": encoded[index].numel(), "prompt_sha256": _token_hash(encoded[index])}
        rows.append({"index": index, **identity, "plain": plain_summary, "runs": runs})
        ran += 1
        if on_prompt is not None:
            on_prompt(report(in_order(rows)))
    return report(in_order(rows))


def _resumed_rows(earlier: dict, empty: EvalReport, encoded: list[torch.Tensor]) -> list[dict]:
    """The prompts of an earlier report, checked to belong to this evaluation, with their runs as `Run`s."""
    keys = ("target", "drafter", "temperature", "max_new_tokens", "device", "dtype", "prompt_lookup_tokens",
            "block_size", "seed")  # fmt: skip
    missing = [key for key in (*keys, "methods", "prompts") if key not in earlier]
    if missing:
        raise DflashError(f"the earlier report lacks {', '.join(missing)}: it was written by an older dflash or is not "
                          "an eval report; start a new report")  # fmt: skip
    differences = describe_differences(
        {k: earlier.get(k) for k in keys}, {k: getattr(empty, k) for k in keys}, "earlier report", "this eval"
    )
    if set(earlier["methods"]) != set(empty.methods):
        differences += f"; methods: earlier report {sorted(earlier['methods'])}, this eval {sorted(empty.methods)}"
    if differences:
        raise DflashError(f"cannot resume an eval of other settings ({differences.strip('; ')}); "
                          "start a new report or give the same settings")  # fmt: skip
    rows, seen = [], set()
    try:
        for row in earlier["prompts"]:
            index = row["index"]
            if index in seen:
                raise DflashError(f"the earlier report holds prompt {index} twice; start a new report")
            seen.add(index)
            if not 0 <= index < len(encoded):
                raise DflashError(
                    f"the earlier report holds prompt {index}, this eval has {len(encoded)} prompts; resume with at "
                    "least as many prompts (--num-prompts), or start a new report"
                )
            if row["prompt_sha256"] != _token_hash(encoded[index]):
                raise DflashError(
                    f"the earlier report's prompt {index} is not this prompt file's prompt {index} (other tokens); "
                    "resume with the same prompts, or start a new report"
                )
            if set(row["runs"]) != set(empty.methods) or {"new_tokens", "seconds"} - set(row["plain"]):
                raise KeyError("runs or plain")
            rows.append({**row, "runs": {name: Run(**run) for name, run in row["runs"].items()}})
    except (KeyError, TypeError) as exc:
        raise DflashError(f"the earlier report is not a dflash eval report of this version ({exc!r}); start a new "
                          "report") from None  # fmt: skip
    return rows


def _token_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.to("cpu", torch.int64).numpy().tobytes()).hexdigest()


def _drafter_label(drafter) -> str:
    return str(drafter) if isinstance(drafter, (str, Path)) else "in-memory"


def _methods(target, tokenizer, drafters: list, temperature, prompt_lookup_tokens, block_size, seed, eos_ids) -> dict:
    methods = {}
    for drafter in drafters:
        model, config = _drafter_and_config(drafter, target, tokenizer, block_size, seed)
        name = "untrained-dflash" if drafter == "untrained" else "dflash"
        if name in methods:
            raise DflashError(f"two drafters would both be reported as {name!r}; evaluate them in separate runs")
        methods[name] = SpeculativeMethod(DFlashProposer(model, config, target), config.block_size - 1, temperature)
    if prompt_lookup_tokens:
        proposer = PromptLookupProposer(prompt_lookup_tokens, eos_ids=eos_ids)
        methods["prompt-lookup"] = SpeculativeMethod(proposer, prompt_lookup_tokens, temperature)
        # transformers refuses assisted generation on stateful (hybrid) models.
        if not getattr(target, "_is_stateful", False):
            methods["prompt-lookup-generate"] = GenerateLookupMethod(prompt_lookup_tokens)
    return methods
