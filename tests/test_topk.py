"""vocab_top_k against a full sort: the same values in the same order, and ids that hold them, ties included."""

import pytest
import torch

from dflash.topk import vocab_top_k


def sorted_reference(x, k):
    return x.sort(dim=-1, descending=True).values[:, :k]


@pytest.mark.parametrize("vocab", [64, 100, 1000])  # whole segments only, a remainder, many segments
@pytest.mark.parametrize("segment", [4, 16, 512])  # 512 > 100: plain topk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_ids_equal_a_full_sort(vocab, segment, dtype):
    g = torch.Generator().manual_seed(vocab + segment)
    k = 5
    x = torch.randn(37, vocab, generator=g).to(dtype)
    values, ids = vocab_top_k(x, k, segment)
    assert torch.equal(values, sorted_reference(x, k))
    assert torch.equal(x.gather(1, ids), values)
    assert ids.dtype == torch.int64


def test_ties_across_segments_keep_every_tied_value():
    """Small integers: most values are tied, and the k-th largest sits in many segments at once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (50, 96), generator=g).float()
    x[3] = 0  # a row of one value
    x[4, ::8] = 9  # the top values spread one per segment
    values, ids = vocab_top_k(x, 6, segment=8)
    assert torch.equal(values, sorted_reference(x, 6))
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == 6 for row in ids.tolist())  # six distinct ids per row


def test_the_top_values_all_in_one_segment():
    x = torch.zeros(2, 64)
    x[:, 40:44] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    values, ids = vocab_top_k(x, 4, segment=8)
    assert values.tolist() == [[4.0, 3.0, 2.0, 1.0]] * 2
    assert ids.tolist() == [[40, 41, 42, 43]] * 2
