"""vocab_top_k against a full sort: the same values in the same order, and ids that hold them, ties included."""

import pytest
import torch

from dflash.topk import vocab_reductions, vocab_top_k


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


@pytest.mark.parametrize("vocab", [64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reductions_equal_float64_logsumexp_first_argmax_and_top_k(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = (3 * torch.randn(41, vocab, generator=g)).to(dtype)
    x[5] = x[5].round()  # many ties at the maximum: the first index must win, as torch.argmax's
    x[6, : vocab // 2] = x[6].max() + 1  # the maximum tied across whole segments
    reduced = vocab_reductions(x, 5, torch.float32, segment=16)
    torch.testing.assert_close(reduced.lse.double(), x.double().logsumexp(-1), rtol=1e-6, atol=1e-6)
    first_max = torch.tensor([row.tolist().index(max(row.tolist())) for row in x.float()])
    assert torch.equal(reduced.argmax, first_max)
    assert torch.equal(reduced.values, sorted_reference(x, 5))
    assert torch.equal(x.gather(1, reduced.ids), reduced.values)


def test_reductions_with_the_maximum_in_the_remainder_columns():
    x = torch.zeros(3, 100)
    x[0, 97] = 5.0  # only in the columns past the last whole segment
    x[1, [10, 98]] = 5.0  # in a segment and in the remainder: the segment's index is first
    x[2, 99] = -1.0
    reduced = vocab_reductions(x, 4, torch.float64, segment=16)
    assert reduced.argmax.tolist() == [97, 10, 0]
    torch.testing.assert_close(reduced.lse, x.double().logsumexp(-1))
