import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash.drafter import graph
from dflash.drafter.blocks import (
    MASK_COMPILE_OPTIONS,
    block_attention_mask,
    block_embeddings,
    block_inputs,
    default_gamma,
    dense_block_mask,
    sample_anchors,
    segment_ids,
    window_anchors,
)
from dflash.errors import DflashError

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def make_row_data(R, T, seed, padding=5):
    """Packed rows: documents of random lengths (ids unique per row), right padding (-1), random loss masks."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.full((R, T), -1, dtype=torch.int32)
    position_ids = torch.zeros((R, T), dtype=torch.int32)
    for r in range(R):
        start, doc = 0, 10 * r
        while start < T - padding:
            length = min(int(torch.randint(3, 40, (), generator=g)), T - padding - start)
            doc_ids[r, start : start + length] = doc
            position_ids[r, start : start + length] = torch.arange(length)
            start, doc = start + length, doc + 1
    loss_mask = (torch.rand(R, T, generator=g) < 0.6).to(torch.uint8) * (doc_ids >= 0)
    input_ids = torch.randint(0, 1000, (R, T), generator=g, dtype=torch.int32)
    return input_ids, position_ids, loss_mask, doc_ids


def eligible_by_rule(loss_mask, doc_ids, B):
    """Brute force from the rule: loss on at a, a+B-1 < T, a..a+B-1 in one (non-padding) document."""
    R, T = loss_mask.shape
    out = torch.zeros(R, T, dtype=torch.bool)
    for r in range(R):
        for a in range(T - B + 1):
            docs = set(doc_ids[r, a : a + B].tolist())
            out[r, a] = bool(loss_mask[r, a]) and len(docs) == 1 and docs != {-1}
    return out


def mask_by_rule(anchors, valid, doc_ids, B, window=None):
    """Brute force, one (query, key) pair at a time, from the rule in DFLASH.md. With a window, the query at row
    position a + k sees context kv only if a + k - kv < window: kv = a + k - window + 1 is the oldest it sees, and
    window 1 leaves slot k = 0 no context at all (only its own block)."""
    R, A = anchors.shape
    T = doc_ids.shape[1]
    Q = A * B
    out = torch.zeros(R, Q, T + Q, dtype=torch.bool)
    for r in range(R):
        for q in range(Q):
            j = q // B
            a = int(anchors[r, j])
            for kv in range(T + Q):
                if kv < T:
                    in_window = window is None or a + q % B - kv < window
                    out[r, q, kv] = bool(valid[r, j]) and kv < a and doc_ids[r, kv] == doc_ids[r, a] and in_window
                else:
                    out[r, q, kv] = (kv - T) // B == j
    return out


def expand_block_mask(block_mask):
    """Element-level mask of a BlockMask: full tiles all on, partial tiles through mask_mod, others off."""
    R = block_mask.kv_num_blocks.shape[0]
    Q, KV = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    q, kv = torch.arange(Q)[:, None], torch.arange(KV)[None, :]
    out = torch.zeros(R, Q, KV, dtype=torch.bool)
    for r in range(R):
        element = block_mask.mask_mod(torch.tensor(r), torch.tensor(0), q, kv).expand(Q, KV)
        for i in range(math.ceil(Q / bq)):
            rows = slice(i * bq, (i + 1) * bq)
            partial = block_mask.kv_indices[r, 0, i, : block_mask.kv_num_blocks[r, 0, i]]
            full = block_mask.full_kv_indices[r, 0, i, : block_mask.full_kv_num_blocks[r, 0, i]]
            for t in partial.tolist():
                cols = slice(t * bkv, (t + 1) * bkv)
                out[r, rows, cols] = element[rows, cols]
            for t in full.tolist():
                out[r, rows, t * bkv : (t + 1) * bkv] = True
    return out


def test_segment_ids_split_pieces_that_share_a_doc_id():
    doc_ids = torch.tensor([[4, 4, 4, 4, 4, 7, 7, -1, -1]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 0, 0]])  # doc 4 was split in two pieces, side by side
    assert segment_ids(doc_ids, position_ids).tolist() == [[0, 0, 0, 1, 1, 2, 2, -1, -1]]
    loss_mask = torch.ones_like(doc_ids)
    anchors, valid = sample_anchors(loss_mask, segment_ids(doc_ids, position_ids), 9, 2, torch.tensor(0))
    assert sorted(anchors[valid].tolist()) == [0, 1, 3, 5]  # no block spans the piece boundary at 3


def test_anchors_are_eligible_distinct_sorted_and_counted():
    B, A = 4, 12
    _, _, loss_mask, doc_ids = make_row_data(3, 60, seed=1)
    loss_mask[2] = 0
    loss_mask[2, 7] = 1  # row 2: exactly one eligible position
    eligible = eligible_by_rule(loss_mask, doc_ids, B)
    for generator in (torch.Generator().manual_seed(0), torch.tensor(123)):
        anchors, valid = sample_anchors(loss_mask, doc_ids, A, B, generator)
        assert anchors.shape == valid.shape == (3, A) and anchors.dtype == torch.int64
        assert (anchors[:, 1:] >= anchors[:, :-1]).all()
        for r in range(3):
            chosen = anchors[r][valid[r]]
            assert valid[r].sum() == min(A, int(eligible[r].sum()))
            assert eligible[r, chosen].all() and len(set(chosen.tolist())) == len(chosen)
            assert not valid[r, int(valid[r].sum()) :].any()  # the surplus sorts last
            assert (anchors[r][~valid[r]] == 60 - B).all()


def test_windows_anchor_every_eligible_position_once():
    B, A, T = 4, 7, 60  # 9 windows, the last one partly past the row
    _, _, loss_mask, doc_ids = make_row_data(3, T, seed=2)
    eligible = eligible_by_rule(loss_mask, doc_ids, B)
    seen = torch.zeros(3, T, dtype=torch.int64)
    for window in range(math.ceil(T / A)):
        anchors, valid = window_anchors(loss_mask, doc_ids, torch.tensor(window), A, B)
        assert anchors.shape == valid.shape == (3, A) and (anchors[:, 1:] >= anchors[:, :-1]).all()
        assert (anchors <= T - B).all()
        for r in range(3):
            seen[r, anchors[r][valid[r]]] += 1
    assert torch.equal(seen, eligible.long())


@pytest.mark.parametrize("seeded", ["generator", "tensor"])
def test_anchors_deterministic_and_uniform(seeded):
    def seed(s):
        return torch.Generator().manual_seed(s) if seeded == "generator" else torch.tensor(s)

    R, T, B, A = 4000, 20, 4, 3
    loss_mask = torch.zeros(R, T, dtype=torch.uint8)
    loss_mask[:, 5:15] = 1  # positions 5..14 are eligible (the block fits before T)
    doc_ids = torch.zeros(R, T, dtype=torch.int32)
    first, _ = sample_anchors(loss_mask, doc_ids, A, B, seed(7))
    again, _ = sample_anchors(loss_mask, doc_ids, A, B, seed(7))
    other, _ = sample_anchors(loss_mask, doc_ids, A, B, seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    counts = torch.bincount(first.flatten(), minlength=T)
    assert counts[:5].sum() == 0 and counts[15:].sum() == 0
    expected = R * A / 10  # 1200 each, standard deviation about 29
    assert ((counts[5:15] - expected).abs() < 150).all(), counts


def test_per_row_keys_make_anchors_independent_of_the_batch_slot():
    _, _, loss_mask, doc_ids = make_row_data(3, 80, seed=6)
    keys = torch.tensor([[11], [12], [13]])
    anchors, valid = sample_anchors(loss_mask, doc_ids, 6, 4, keys)
    order = torch.tensor([2, 0, 1])
    moved, moved_valid = sample_anchors(loss_mask[order], doc_ids[order], 6, 4, keys[order].flatten())
    assert torch.equal(moved, anchors[order]) and torch.equal(moved_valid, valid[order])
    same_data = sample_anchors(loss_mask[[0, 0]], doc_ids[[0, 0]], 6, 4, torch.tensor(4))[0]
    assert not torch.equal(same_data[0], same_data[1])  # a scalar seed: rows draw distinct streams


def test_anchors_compile_fullgraph_with_seed_tensor():
    _, _, loss_mask, doc_ids = make_row_data(2, 50, seed=2)
    compiled = torch.compile(sample_anchors, fullgraph=True, backend="aot_eager")
    for seed in (torch.tensor(5), torch.tensor([[5], [6]])):
        got = compiled(loss_mask, doc_ids, 8, 4, seed)
        want = sample_anchors(loss_mask, doc_ids, 8, 4, seed)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_anchors_reject_rows_that_cannot_hold_a_block():
    loss_mask = torch.ones(1, 3, dtype=torch.uint8)
    with pytest.raises(DflashError, match="token budget"):
        sample_anchors(loss_mask, torch.zeros(1, 3, dtype=torch.int32), 1, 4)


def test_block_inputs_hand_checked():
    B, MASK = 4, 99
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # two documents of 5
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 5, 6]]), torch.tensor([[True, True, False]])
    block_ids, q_positions, labels, weights = block_inputs(
        input_ids, position_ids, loss_mask, anchors, valid, MASK, B, gamma=2.0
    )
    assert block_ids.tolist() == [[12, MASK, MASK, MASK, 15, MASK, MASK, MASK, 16, MASK, MASK, MASK]]
    assert q_positions.tolist() == [[2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 3, 4]]
    # the label of block position k is the token at anchor + k (position 0's label carries no weight)
    assert labels.tolist() == [[12, 13, 14, 15, 15, 16, 17, 18, 16, 17, 18, 19]]
    e = math.exp
    want = [0, 1 * 1, e(-1 / 2) * 0, e(-2 / 2) * 1, 0, 1, e(-1 / 2), e(-2 / 2), 0, 0, 0, 0]
    torch.testing.assert_close(weights, torch.tensor([want], dtype=torch.float32))
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4


def test_block_embeddings_are_the_block_ids_looked_up_in_the_table():
    """--embedding host: the anchors' rows of the row's token embeddings and the mask token's row, bit for bit what
    the table gives block_inputs' ids (invalid anchors included)."""
    B, MASK, V, H = 4, 7, 50, 8
    input_ids, position_ids, loss_mask, doc_ids = make_row_data(2, 40, seed=5)
    input_ids = input_ids % V
    anchors, valid = sample_anchors(loss_mask, doc_ids, 6, B, torch.tensor(2))
    valid[1, -1] = False
    table = torch.randn(V, H, generator=torch.Generator().manual_seed(0)).bfloat16()
    block_ids, *_ = block_inputs(input_ids, position_ids, loss_mask, anchors, valid, MASK, B)
    got = block_embeddings(table[input_ids.long()], anchors, table[MASK], B)
    assert torch.equal(got, table[block_ids])


@pytest.mark.parametrize("window", [None, 1, 2, 5, 17])
def test_dense_mask_equals_rule(window):
    B = 4
    _, _, loss_mask, doc_ids = make_row_data(2, 40, seed=3)
    anchors, valid = sample_anchors(loss_mask, doc_ids, 6, B, torch.tensor(1))
    valid[0, 0] = False  # an invalid anchor at a real position too
    want = mask_by_rule(anchors, valid, doc_ids, B, window)
    assert torch.equal(dense_block_mask(anchors, valid, doc_ids, B, window), want)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("tile_size", [16, 32, 64, 128])
def test_block_mask_equals_dense_mask(tile_size, window):
    # Several 128-tiles in both directions, documents crossing tiles, padding, invalid anchors.
    B, A, T = 16, 24, 300
    _, _, loss_mask, doc_ids = make_row_data(2, T, seed=4, padding=20)
    loss_mask[0, 40:] = 0  # row 0 has fewer eligible positions than anchors
    doc_ids[1, :280] = 7  # row 1 is one long document: whole context tiles become visible
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, B, torch.tensor(9))
    assert not valid[0].all() and valid[0].any() and valid[1].all()
    # Every tile size and window: the tiles skipped hold no visible pair, the full ones only visible pairs.
    block_mask = block_attention_mask(anchors, valid, doc_ids, B, window, tile_size)
    assert block_mask.BLOCK_SIZE == (tile_size, tile_size)
    assert window is not None or block_mask.full_kv_num_blocks[1].sum() > 0
    dense = dense_block_mask(anchors, valid, doc_ids, B, window)
    assert block_mask.seq_lengths == (A * B, T + A * B)
    assert torch.equal(expand_block_mask(block_mask), dense)


def visited_tiles(block_mask) -> torch.Tensor:
    """[R, query tiles, KV tiles] bool: the tiles flex_attention computes (partly or fully visible)."""
    return block_mask.to_dense().bool()[:, 0]


def test_a_window_skips_the_context_tiles_outside_it():
    # One long document: full context makes a staircase of tiles, a window a band along it.
    B, A, T, window, tile = 16, 64, 8192, 512, 128
    loss_mask = torch.ones(1, T, dtype=torch.uint8)
    doc_ids = torch.zeros(1, T, dtype=torch.int32)
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, B, torch.tensor(5))
    full = visited_tiles(block_attention_mask(anchors, valid, doc_ids, B, tile_size=tile))
    windowed = visited_tiles(block_attention_mask(anchors, valid, doc_ids, B, window, tile_size=tile))
    assert (windowed <= full).all()
    context_tiles = T // tile
    assert windowed[..., :context_tiles].sum() * 3 < full[..., :context_tiles].sum()
    # The blocks of query tile i see the context tiles that meet one of their spans [a_j - window + 1, a_j - 1]
    # (the union over the block's slots k of a_j + k - window < kv < a_j), and only those.
    assert valid.all()
    starts = torch.arange(context_tiles) * tile
    for i in range(A * B // tile):
        tile_anchors = anchors[0, i * (tile // B) : (i + 1) * (tile // B), None]
        meets = (starts <= tile_anchors - 1) & (starts + tile - 1 >= tile_anchors - window + 1)
        assert torch.equal(windowed[0, i, :context_tiles], meets.any(0))


def test_mask_compiled_with_the_trainers_options_equals_eager():
    # The trainer compiles the builder with MASK_COMPILE_OPTIONS (inductor falls back to ATen's sort): the options
    # must be ones inductor accepts, and the mask must not change.
    B, A, T = 16, 24, 300
    _, _, loss_mask, doc_ids = make_row_data(2, T, seed=6, padding=20)
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, B, torch.tensor(2))
    compiled = graph.compile_fn(block_attention_mask, True, options=MASK_COMPILE_OPTIONS)
    eager = block_attention_mask(anchors, valid, doc_ids, B)
    assert torch.equal(compiled(anchors, valid, doc_ids, B).to_dense(), eager.to_dense())
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        graph.compile_fn(block_attention_mask, True, options={"no_such_option": 1})(anchors, valid, doc_ids, B)


def test_flex_attention_with_block_mask_equals_masked_softmax():
    B, A, T, heads, D = 8, 10, 90, 2, 8
    _, _, loss_mask, doc_ids = make_row_data(2, T, seed=5)
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, B, torch.tensor(3))
    valid[1, -1] = False
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, A * B, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, heads, T + A * B, D, generator=g, dtype=torch.float64)
    v = torch.randn(2, heads, T + A * B, D, generator=g, dtype=torch.float64)
    out = flex_attention(q, k, v, block_mask=block_attention_mask(anchors, valid, doc_ids, B))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~mask_by_rule(anchors, valid, doc_ids, B)[:, None], float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v, rtol=1e-10, atol=1e-10)
