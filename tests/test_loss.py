import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.loss import (
    block_hits,
    block_stats,
    default_chunk_size,
    dpace_weights,
    head_cross_entropy,
    leading_runs,
    normaliser,
    position_weights,
    replay_decoding,
)


def make_inputs(N=37, H=12, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))  # requires grad on purpose
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g, dtype=torch.float64) * (torch.rand(N, generator=g) < 0.7)
    return hidden, head, labels, weights


def reference_loss(hidden, head, labels, weights):
    """The formula with full logits: sum(w * CE) / sum(w)."""
    ce = F.cross_entropy(hidden @ head.T, labels, reduction="none")
    return (weights * ce).sum() / weights.sum()


def weighted_loss(hidden, head, labels, weights, chunk_size=None, **kw):
    ce, correct, top = head_cross_entropy(hidden, head, labels, chunk_size, **kw)
    return (weights * ce).sum() / weights.sum(), correct, ce, top


@pytest.mark.parametrize("chunk_size", [37, 8, 5, 100, None])  # one chunk, ragged last chunks, > N, default
def test_loss_and_grad_equal_full_logits(chunk_size):
    hidden, head, labels, weights = make_inputs()
    loss, correct, ce, top = weighted_loss(hidden, head, labels, weights, chunk_size, top_k=4)
    loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref = reference_loss(ref_hidden, head.detach(), labels, weights)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)
    logits = hidden.detach() @ head.T
    assert torch.equal(correct, logits.argmax(-1) == labels)
    torch.testing.assert_close(ce.detach(), F.cross_entropy(logits, labels, reduction="none"))
    assert torch.equal(top, logits.topk(4, dim=-1).indices)
    assert head.grad is None  # the frozen head never gets a weight gradient


def test_weights_computed_from_the_ces_get_the_exact_gradient():
    """The backward scales each row by its CE's upstream gradient, so a weighting that reads the CEs (D-PACE's,
    detached) gives the gradient of sum(w * CE) with those w held fixed."""
    hidden, head, labels, _ = make_inputs()
    ce, _, _ = head_cross_entropy(hidden, head, labels, 8)
    w = torch.exp(-ce.detach()) + 0.5
    (w * ce).sum().backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    (w * F.cross_entropy(ref_hidden @ head.detach().T, labels, reduction="none")).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)


def test_loss_scales_with_upstream_gradient():
    hidden, head, labels, weights = make_inputs()
    loss, *_ = weighted_loss(hidden, head, labels, weights, 8)
    (3 * loss).backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    (3 * reference_loss(ref_hidden, head.detach(), labels, weights)).backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)


def test_no_grad_and_compiled_paths():
    hidden, head, labels, weights = make_inputs()
    with torch.no_grad():
        eager = weighted_loss(hidden, head, labels, weights, 8)[0]
    compiled = torch.compile(weighted_loss, fullgraph=True, backend="aot_eager")
    loss, correct, *_ = compiled(hidden, head, labels, weights, 8)
    loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    reference_loss(ref_hidden, head.detach(), labels, weights).backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10, atol=1e-12)


def dpace_reference(ce: np.ndarray, trained: np.ndarray, block_size: int, floor: float) -> np.ndarray:
    """D-PACE's formula as loops in float64: q~_i = (1 - a) exp(-CE_i) + a on trained positions (1 elsewhere),
    w_j = sum over m >= j of prod over i <= m of q~_i, 0 where untrained."""
    out = np.zeros_like(ce, dtype=np.float64)
    for b in range(len(ce) // block_size):
        block = slice(b * block_size, (b + 1) * block_size)
        q = np.where(trained[block], (1 - floor) * np.exp(-ce[block].astype(np.float64)) + floor, 1.0)
        for j in range(block_size):
            if trained[block][j]:
                out[b * block_size + j] = sum(np.prod(q[: m + 1]) for m in range(j, block_size))
    return out


def test_dpace_weights_equal_the_formula():
    g = torch.Generator().manual_seed(3)
    B = 8
    ce = torch.rand(5 * B, generator=g, dtype=torch.float64) * 4
    trained = torch.rand(5 * B, generator=g) < 0.8
    trained.view(-1, B)[:, 0] = False  # the anchor slot
    trained.view(-1, B)[3] = False  # an invalid anchor
    got = dpace_weights(ce, trained, B, floor=0.5)
    want = dpace_reference(ce.numpy(), trained.numpy(), B, 0.5)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6)
    assert (got[~trained] == 0).all() and (got.view(-1, B)[0, 1:][trained.view(-1, B)[0, 1:]] >= 0.5**7).all()


def test_position_weights_and_their_normalisers():
    decayed = torch.tensor([0.0, 1.0, 0.9, 0.0, 0.0, 1.0, 0.9, 0.8])
    ce = torch.tensor([9.0, 0.1, 2.0, 1.0, 9.0, 0.3, 0.2, 5.0])
    assert torch.equal(position_weights("decay", ce, decayed, 4), decayed)
    assert torch.equal(normaliser("decay", decayed), decayed)
    torch.testing.assert_close(position_weights("dpace", ce, decayed, 4), dpace_weights(ce, decayed > 0, 4))
    assert torch.equal(normaliser("dpace", decayed), (decayed > 0).float())


def test_default_chunk_size_bounds_the_logits():
    assert default_chunk_size(248320) == default_chunk_size(151936) == 2048
    assert default_chunk_size(50) * 50 <= 2**29 < default_chunk_size(50) * 100
    assert default_chunk_size(2**31) == 1


def test_block_stats_hand_checked():
    B = 4
    # 3 anchors; anchor 2 is invalid (all weights 0); anchor 1's position 3 is untrained (loss mask off).
    correct = torch.tensor([1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    weights = torch.tensor([0, 1, 0.9, 0.8, 0, 1, 0.9, 0, 0, 0, 0, 0])
    stats = block_stats(correct, weights, B)
    assert stats.correct.tolist() == [2, 1, 0] and stats.counted.tolist() == [2, 2, 1]
    # anchor 0: right at k=1,2, wrong at k=3 -> 1 + 2; anchor 1: right at k=1, wrong at k=2 -> 1 + 1
    assert stats.anchors.item() == 2 and stats.accepted.item() == 5
    assert stats.accepted.item() / stats.anchors.item() == 2.5  # the acceptance length
    both = block_stats(correct.view(1, -1), weights.view(1, -1), B)  # [R, Q] input reads the same
    assert all(torch.equal(a, b) for a, b in zip(stats, both))


def test_block_stats_accepts_the_whole_block():
    correct, weights = torch.ones(2, 16, dtype=torch.bool), torch.ones(2, 16)
    stats = block_stats(correct, weights, 16)
    assert stats.accepted.item() / stats.anchors.item() == 16 and stats.correct.tolist() == stats.counted.tolist()


def test_leading_runs_hand_checked():
    correct = torch.tensor([1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    weights = torch.tensor([0, 1, 0.9, 0.8, 0, 1, 0.9, 0, 0, 0, 0, 0])
    run, counted = leading_runs(*block_hits(correct, weights, 4))
    assert run.tolist() == [2, 1, 0] and counted.tolist() == [True, True, False]


def test_replay_decoding_hand_checked():
    runs = np.array(
        [
            # answer at 0..5: a=0 accepts 3 (commits 4 tokens), a=4 accepts 1 (2 tokens), a=6 leaves it: 2 rounds, 6
            # tokens; the 9 at 1 and the 5 at 3 are skipped. Answer at 8..9: a=8 accepts 0, a=9 accepts 0: 2 rounds.
            [3, 9, 0, 5, 1, 0, -1, -1, 0, 0, -1],
            [-1, -1, 15, 0, 0, 0, 0, 0, 0, 0, 0],  # one round commits 16 tokens and leaves the answer
        ]
    )
    assert replay_decoding(runs) == (5, 6 + 2 + 16)
    assert replay_decoding(np.full((2, 5), -1)) == (0, 0)
