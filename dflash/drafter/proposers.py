"""Proposers: what drafts the tokens a speculative round verifies (dflash.evaluate.decoding runs the rounds).

A proposer sees the committed tokens and the target features of every committed token but the last, and returns
a Draft: the tokens, and at temperature > 0 the distribution q each was drawn from, which lossless verification
needs. Torch only (no transformers import), so drafter methods can define theirs beside their model.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dflash.drafter.graph import CapturedCall, compile_decoding
from dflash.errors import DflashError

# Graphed drafting pads the context to a multiple of this (or of an eighth of the context's power of two, when
# larger): one CUDA graph per bucket, at most 8 buckets per doubling of the context, at most 1/8 of it padding.
CONTEXT_BUCKET = 256
FORWARD_SIGNATURES = 96  # buckets of one drafter's graphed forward: contexts up to 2 M tokens


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] proposed continuation of the committed tokens
    probs: torch.Tensor | None = None  # [k, V] distribution q each token was sampled from; None = a point mass

    def first(self, count: int) -> "Draft":
        return Draft(self.tokens[:count], None if self.probs is None else self.probs[:count])


@dataclass(frozen=True)
class DecodingOptions:
    """Options of a drafter's decoding rule that `dflash eval` passes on; a method refuses those it has not."""

    confidence_cut: float | None = None  # DSpark: end the drafts where the predicted prefix acceptance drops below


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


def inverse_cdf(q: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of q [..., n], the index at which its running sum (float64) first exceeds `uniform` (in [0, 1),
    broadcast against q with the last dimension kept: a 0-d tensor for one row): an exact sample of each row drawn on
    the device, where torch.multinomial would take a generator that torch.compile cannot trace. A token of
    probability 0 is never picked; the last index stands in for a running sum that rounds below `uniform`."""
    return (q.double().cumsum(-1) <= uniform).sum(-1).clamp_max(q.shape[-1] - 1)


def uniforms(count: int, temperature: float, generator, device) -> torch.Tensor | None:
    """One uniform per draft for a walk's inverse_cdf picks, drawn outside the compiled part; None at T = 0."""
    if temperature == 0:
        return None
    return torch.rand(count, generator=generator, device=device, dtype=torch.float64)


class DFlashProposer:
    """Drafts with a DFlash drafter through the target's own embeddings and LM head: one forward of the block
    [last committed, MASK x (B-1)] at the next absolute positions, then `choose` (here: draw from the LM head's
    logits; a method's proposer may choose otherwise from the same hidden states).

    `compiled`: run the drafter's forward, and a method's drafting from the block's hidden states (`device_part`),
    through torch.compile with dynamic sizes (graph.compile_decoding). With `cuda_graph` both are replayed on CUDA
    from CUDA graphs (graph.CapturedCall): the forward sees its context padded to a bucket (context_width) and
    masked, one graph per bucket; the drafting from the block, whose shapes never change, is compiled at static
    shapes. The first calls compile, each bucket's first call captures (`dflash eval` warms up first)."""

    def __init__(
        self,
        drafter,
        config,
        target,
        options: DecodingOptions = DecodingOptions(),
        compiled: bool = False,
        cuda_graph: bool = False,
        context_bucket: int = CONTEXT_BUCKET,
    ):
        self.drafter = drafter
        self.compiled, self.cuda_graph = compiled, cuda_graph
        self.context_bucket = context_bucket
        self.forward = self.device_part(drafter, max_signatures=FORWARD_SIGNATURES, dynamic=True)
        self.config = config
        self.options = options
        self.check_options(options)
        self.block_size = config.block_size
        self.first_draft = 0 if config.anchor_predicts else 1  # the block slot of the first draft
        self.mask_token_id = config.mask_token_id
        self.layer_ids = list(config.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()

    def propose(self, committed, features, num_tokens, temperature, generator) -> Draft:
        if num_tokens == 0:
            return Draft(committed.new_empty(0))
        context, device = committed.numel() - 1, committed.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=committed.dtype, device=device)
        block[0, 0] = committed[-1]
        q_positions = torch.arange(context, context + self.block_size, device=device)[None]
        width = context_width(context, self.context_bucket) if self.graphed else None
        if width is not None:  # zero rows past the context, which the mask hides
            features = F.pad(features, (0, 0, 0, width - context))
        ctx_positions = torch.arange(features.shape[0], device=device)[None]
        mask = window_mask(context, self.block_size, self.config.sliding_window, device, width)
        hidden = self.forward(self.embed(block), features[None], q_positions, ctx_positions, mask)
        # Block slot 0 holds the known token; the slots from first_draft on predict the tokens after it.
        # Every slot after the anchor is drafted, then cut to num_tokens: the choice sees one shape in every round
        # (compiled, a walk over a shorter block would be another graph), and a left-to-right draft's first
        # tokens do not depend on the ones after them.
        draft = self.choose(hidden[0, self.first_draft :], committed[-1], temperature, generator)
        return draft.first(num_tokens)

    def device_part(self, fn: Callable, **capture) -> Callable:
        """fn as `compiled` and `cuda_graph` say: itself, compiled with dynamic sizes, or a CapturedCall (with the
        options in `capture`; by default compiled at static shapes, as a method's drafting from the block is)."""
        if not self.compiled:
            return fn
        if self.cuda_graph:
            return CapturedCall(fn, self.device, **capture)
        return compile_decoding(fn)

    @property
    def graphed(self) -> bool:
        """Whether the forward runs as a CapturedCall, over a context padded to its bucket."""
        return self.compiled and self.cuda_graph

    @property
    def device(self) -> torch.device:
        return next(self.drafter.parameters()).device

    def check_options(self, options: DecodingOptions) -> None:
        if options.confidence_cut is not None:
            raise DflashError("--confidence-cut needs a DSpark drafter with a confidence head")

    def choose(self, hidden: torch.Tensor, anchor: torch.Tensor, temperature: float, generator) -> Draft:
        """The drafts from the hidden states [k, H] of the block slots after the anchor token (a 0-d tensor)."""
        return draw(self.head(hidden), temperature, generator)


def context_width(context: int, bucket: int = CONTEXT_BUCKET) -> int:
    """The padded context length of graphed drafting: `context` rounded up to its bucket."""
    step = max(bucket, 1 << max(context.bit_length() - 4, 0))
    return max(1, -(-context // step)) * step


def window_mask(context: int, block: int, window: int | None, device, width: int | None = None) -> torch.Tensor | None:
    """The attention of one block after `context` tokens at inference, as a bool [1, 1, B, width + B]: context
    position j is visible to the block token at position p = context + k iff j < context (the rest is padding) and,
    with a sliding window, p - j < window; the block's own tokens always are. Without `width` (unpadded) None where
    everything is visible; with it (graphed drafting: one signature per bucket) always a mask."""
    if width is None:
        if window is None or context + block - 1 < window:
            return None
        width = context
    q = torch.arange(context, context + block, device=device)
    j = torch.arange(width, device=device)
    sees = (j < context)[None, :].expand(block, -1)
    if window is not None:
        sees = sees & (q[:, None] - j[None, :] < window)
    own = torch.ones(block, block, dtype=torch.bool, device=device)
    return torch.cat([sees, own], dim=1)[None, None]


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
