"""Anchors, block inputs / labels / weights and the attention mask of a DFlash training step.

Everything here has fixed shapes and stays on the device (no nonzero, no randperm, no .item()), so a whole step
can be compiled with fullgraph=True and captured in a CUDA graph.

Layout of one row (R rows, T tokens, A anchors, block size B, Q = A*B block tokens):
    queries:  [block 0 | block 1 | ... | block A-1]                 (Q)
    keys:     [context 0..T-1 | block 0 | ... | block A-1]          (T + Q)
Block j = [input_ids[a_j], MASK x (B-1)] at positions position_ids[a_j] + k; output k (1 <= k < B) predicts
input_ids[a_j + k] (not shifted once more). It sees context strictly before a_j in its own document and its own
block in both directions, nothing else. A drafter whose anchor slot drafts too (DSpark) has output k predict
input_ids[a_j + k + 1]: its labels span S = B + 1 tokens from the anchor (`block_inputs`' span, `span_outputs`).
"""

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from dflash.errors import DflashError

# The paper's loss-decay gamma per block size; other sizes use B / 2, which is close to the paper's three values.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}

_U32 = 0xFFFFFFFF

# Inductor options for compiling block_attention_mask. create_block_mask orders block indices with argsort; with
# persistent reductions on, inductor lowers a sort over at most a few hundred KV blocks to a Triton sort kernel
# whose cold compile can take minutes (pytorch issue 182060). Off, those sorts fall back to ATen's, which costs
# nothing at these sizes (a few thousand block indices per step). bench/mask_compile.py measures both.
MASK_COMPILE_OPTIONS = {"triton.persistent_reductions": False}

# Query and key positions per side of a BlockMask tile (create_block_mask's BLOCK_SIZE): torch's default.
# flex_attention skips the tiles where no pair is visible and evaluates mask_mod only in partly visible ones; its
# kernel tiles (BLOCK_M, BLOCK_N, ...) must divide this size. The trainer's choice: dflash.drafter.attention.
TORCH_MASK_TILE = 128


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, block_size / 2)


def segment_ids(doc_ids: Tensor, position_ids: Tensor) -> Tensor:
    """[R, T] int32 ids that are unique per contiguous document within a row (-1 on padding).

    The store's doc_ids name the source line, so two pieces of one split document share an id and may sit side
    by side in a row; a piece starts where the position restarts. Pass these ids as `doc_ids` below so that a
    block never sees, nor spans into, another piece.
    """
    continues = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (position_ids[:, 1:] == position_ids[:, :-1] + 1)
    starts = torch.cat([torch.ones_like(continues[:, :1]), ~continues], dim=1)
    return torch.where(doc_ids >= 0, starts.int().cumsum(dim=1, dtype=torch.int32) - 1, -1)


def eligible_anchors(loss_mask: Tensor, doc_ids: Tensor, block_size: int) -> Tensor:
    """[R, T] bool: a can anchor a block iff loss_mask[a] is on and a..a+B-1 lie in one document.

    As in SpecForge, the anchor itself must be a trained (response) token: at inference the anchor is always a
    token the target produced. The following tokens' loss mask only weighs their labels (see block_inputs).
    Documents are contiguous runs of one doc id, so doc[a] == doc[a+B-1] means the whole block is inside it;
    padding (doc id -1) never anchors.
    """
    T = loss_mask.shape[1]
    fits = torch.zeros_like(loss_mask, dtype=torch.bool)
    fits[:, : T - block_size + 1] = doc_ids[:, block_size - 1 :] == doc_ids[:, : T - block_size + 1]
    return fits & (loss_mask != 0) & (doc_ids >= 0)


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32); multiplier < 2^27, so no overflow."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _U32
    return (x >> 16) ^ x


def _noise(shape, generator, device) -> Tensor:
    """Random scores >= 0 [R, T]. A seed tensor gives counter-based noise that torch.compile can trace and a CUDA
    graph can replay (rewrite the seed in place each step); a torch.Generator (or None) uses torch.rand."""
    if not isinstance(generator, Tensor):
        return torch.rand(shape, generator=generator, device=device)
    R, T = shape
    key = generator.to(device=device, dtype=torch.int64).reshape(-1, 1) & _U32  # [1, 1] or one key per row
    if key.shape[0] == 1:  # one seed for the batch: every row gets a stream of its own
        key = _hash32(key) ^ torch.arange(R, device=device)[:, None]
    # Hashing positions first makes two keys' inputs unrelated sets, not shifted or permuted copies of each other.
    return _hash32(_hash32(torch.arange(T, device=device)) ^ _hash32(key))


def sample_anchors(
    loss_mask: Tensor, doc_ids: Tensor, num_anchors: int, block_size: int, generator=None
) -> tuple[Tensor, Tensor]:
    """Draw `num_anchors` distinct eligible positions per row, uniformly, without replacement.

    Returns anchors [R, A] int64 sorted ascending and valid [R, A] bool. Rows with fewer than A eligible positions
    keep the shape: the surplus is invalid, sorts last and points at T - B (so every block index stays in range).
    generator: a torch.Generator / None (eager), or an int64 seed tensor (compiled / CUDA-graphed steps): a scalar
    (rows draw distinct streams), or one key per row, [R] or [R, 1], so that a row's anchors depend on its key and
    its data only, not on its slot in the batch.
    """
    R, T = loss_mask.shape
    if not block_size <= T or not 0 < num_anchors <= T:
        raise DflashError(
            f"a row of {T} tokens cannot hold {num_anchors} anchors of block size {block_size}; "
            "raise the token budget or lower the anchor count / block size"
        )
    eligible = eligible_anchors(loss_mask, doc_ids, block_size)
    scores = torch.where(eligible, _noise((R, T), generator, loss_mask.device), -1)
    top, index = scores.topk(num_anchors, dim=1)  # random eligible positions first, then ineligible ones
    anchors = torch.where(top >= 0, index, T).sort(dim=1).values
    valid = anchors < T
    return torch.where(valid, anchors, T - block_size), valid


def window_anchors(
    loss_mask: Tensor, doc_ids: Tensor, window: Tensor, num_anchors: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Every position of window `window` (window * A .. window * A + A - 1) as an anchor, valid where eligible.

    Windows 0 .. ceil(T / A) - 1 together anchor every eligible position once: validation scores all of them,
    which the replay of decoding needs (loss.replay_decoding). window: an int64 device scalar, so that one
    captured step replays every window. Returns anchors [R, A] (ascending; past T - B clamped there, invalid) and
    valid [R, A] bool, like sample_anchors.
    """
    R, T = loss_mask.shape
    positions = window * num_anchors + torch.arange(num_anchors, device=loss_mask.device)
    eligible = eligible_anchors(loss_mask, doc_ids, block_size)
    valid = (positions < T) & eligible.gather(1, positions.clamp(max=T - 1).expand(R, -1))
    return positions.clamp(max=T - block_size).expand(R, -1).contiguous(), valid


def block_inputs(
    input_ids: Tensor,
    position_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    mask_token_id: int,
    block_size: int,
    gamma: float | None = None,
    span: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Block token ids and positions [R, A*B], and labels and loss weights [R, A*S] (block-major).

    block_ids: input_ids[a] at k=0, mask_token_id after; q_positions: position_ids[a] + k, for the B query slots.
    The S = `span` slots per anchor (default B) carry the labels input_ids[a + k] (the k=0 label is a placeholder
    with weight 0) and the weights (fp32) exp(-(k-1)/gamma) * loss_mask[a+k] * valid for k >= 1, 0 at k = 0. A
    drafter whose anchor slot drafts (S = B + 1) maps its B outputs onto slots 1..B with `span_outputs`.
    """
    R, A = anchors.shape
    span = block_size if span is None else span
    k = torch.arange(span, device=anchors.device)
    index = (anchors[:, :, None] + k).view(R, A * span)
    labels = input_ids.gather(1, index).long()
    slot = torch.arange(block_size, device=anchors.device)
    block_ids = torch.where(slot == 0, input_ids.gather(1, anchors)[:, :, None], mask_token_id).view(R, -1)
    q_positions = (position_ids.gather(1, anchors)[:, :, None].long() + slot).view(R, -1)
    gamma = default_gamma(span) if gamma is None else gamma
    decay = torch.where(k == 0, 0.0, torch.exp(-(k - 1) / gamma)).repeat(A)
    weights = decay * loss_mask.gather(1, index).float() * valid.repeat_interleave(span, dim=1)
    return block_ids.long(), q_positions, labels, weights


def block_embeddings(token_embeds: Tensor, anchors: Tensor, mask_embedding: Tensor, block_size: int) -> Tensor:
    """The block tokens' embeddings [R, A*B, H] from each row's token embeddings [R, T, H] (--embedding host): the
    anchor's at k=0, the mask token's `mask_embedding` [H] after; `block_inputs`' block_ids looked up in the table."""
    R, A = anchors.shape
    H = token_embeds.shape[-1]
    anchor_embeds = token_embeds.gather(1, anchors[:, :, None].expand(R, A, H))[:, :, None]
    slot = torch.arange(block_size, device=anchors.device)[:, None]
    return torch.where(slot == 0, anchor_embeds, mask_embedding).view(R, A * block_size, H)


def span_outputs(hidden: Tensor, block_size: int, span: int) -> Tensor:
    """The drafter's outputs [R, A*B, H] laid out as the labels [R, A*S]: the same for S = B; for S = B + 1 (the
    anchor slot drafts) output j predicts the label of slot j + 1, and slot 0 (never trained) gets zeros."""
    if span == block_size:
        return hidden
    R, Q, H = hidden.shape
    blocks = hidden.view(R, Q // block_size, block_size, H)
    return torch.nn.functional.pad(blocks, (0, 0, span - block_size, 0)).view(R, -1, H)


def span_gather(values: Tensor, anchors: Tensor, span: int, offset: int = 0) -> Tensor:
    """values [R, T, ...] at positions a + k + offset of every anchor's span slots k -> [R, A*S, ...] (positions
    clamped into the row: slots that fall outside it are never trained)."""
    R, A = anchors.shape
    T = values.shape[1]
    index = (anchors[:, :, None] + torch.arange(span, device=anchors.device) + offset).clamp(0, T - 1).view(R, -1)
    index = index.view(R, -1, *([1] * (values.dim() - 2))).expand(R, A * span, *values.shape[2:])
    return values.gather(1, index)


def block_attention_mask(
    anchors: Tensor,
    valid: Tensor,
    doc_ids: Tensor,
    block_size: int,
    window: int | None = None,
    tile_size: int = TORCH_MASK_TILE,
) -> BlockMask:
    """The flex_attention BlockMask of a step: Q_LEN = A*B, KV_LEN = T + A*B, one mask per row, shared by heads.

    Query q of block j = q // B sees context kv < T iff doc[kv] == doc[a_j], kv < a_j and block j is valid, and
    block kv >= T iff it is in block j. A block always sees itself, so no query row is empty. With a sliding
    `window`, context kv is visible to the query at a_j + k only if a_j + k - kv < window (positions run with the
    row within a document). Same structure every step (only tensor values change): a compiled caller does not
    recompile. `tile_size` changes which tiles are skipped, never which pairs are visible.
    """
    R, A = anchors.shape
    T = doc_ids.shape[1]
    Q = A * block_size
    anchor_doc = doc_ids.gather(1, anchors)
    # A document id for every key, the block keys' unread (in_context is false there): an index in range without a
    # clamp, which the CuTe kernels of BACKEND="FLASH" cannot lower (torch 2.11).
    key_doc = torch.cat([doc_ids, doc_ids.new_zeros(R, Q)], dim=1)

    def mask_mod(b, h, q, kv):
        j = q // block_size
        in_context = kv < T
        same_doc = key_doc[b, kv] == anchor_doc[b, j]
        sees_context = in_context & same_doc & (kv < anchors[b, j]) & valid[b, j]
        if window is not None:
            # q's position as a_j + q - j * B rather than through %: one op fewer for BACKEND=FLASH's CuTe lowering
            sees_context = sees_context & (anchors[b, j] + q - j * block_size - kv < window)
        sees_own_block = ~in_context & ((kv - T) // block_size == j)
        return sees_context | sees_own_block

    return create_block_mask(mask_mod, B=R, H=None, Q_LEN=Q, KV_LEN=T + Q, device=anchors.device, BLOCK_SIZE=tile_size)


def dense_block_mask(
    anchors: Tensor, valid: Tensor, doc_ids: Tensor, block_size: int, window: int | None = None
) -> Tensor:
    """The same rule as a dense bool [R, Q, T + Q] tensor, every (query, key) pair evaluated (the reference)."""
    R, A = anchors.shape
    T = doc_ids.shape[1]
    Q = A * block_size
    block_of_query = torch.arange(Q, device=anchors.device) // block_size  # [Q]
    anchor = anchors[:, block_of_query]  # [R, Q]
    anchor_valid = valid[:, block_of_query]
    anchor_doc = doc_ids.gather(1, anchor)
    context = torch.arange(T, device=anchors.device)
    sees_context = (
        (doc_ids[:, None, :] == anchor_doc[:, :, None])
        & (context[None, None, :] < anchor[:, :, None])
        & anchor_valid[:, :, None]
    )
    if window is not None:
        query_position = anchor + torch.arange(Q, device=anchors.device) % block_size  # row index of the query
        sees_context &= query_position[:, :, None] - context[None, None, :] < window
    sees_blocks = (block_of_query[:, None] == block_of_query[None, :]).expand(R, Q, Q)
    return torch.cat([sees_context, sees_blocks], dim=2)


def dense_attention_bias(
    anchors: Tensor, valid: Tensor, doc_ids: Tensor, block_size: int, window: int | None = None
) -> Tensor:
    """dense_block_mask as the additive fp32 bias [R, 1, Q, T + Q] that SDPA takes (0: visible, -inf: hidden).
    SDPA turns a bool mask into exactly this in every call, and autograd keeps each layer's copy for the backward
    (4 bytes a pair a layer); made once here, every layer shares it."""
    visible = dense_block_mask(anchors, valid, doc_ids, block_size, window)[:, None]
    return torch.full(visible.shape, float("-inf"), device=visible.device).masked_fill_(visible, 0.0)
