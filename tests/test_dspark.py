"""DSpark against independent references: the span layout of its labels as index loops, the Markov logits, the
confidence head, the L1 / TV / BCE terms and their gradients as full-vocabulary float64 computations (both teacher
forms), the greedy and sampled Markov walks and the confidence cut as loops, lossless sampling (chi-square), and the
trainer's teacher arrays read at the position before each label."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_drafter import small_config
from torch.utils.flop_counter import FlopCounterMode

from dflash.drafter import blocks, loss
from dflash.drafter.flops import step_flops
from dflash.drafter.proposers import DecodingOptions
from dflash.errors import DflashError
from dflash.evaluate.decoding import accept_sampled, target_probs
from dflash.methods import ObjectiveOptions
from dflash.methods.distill import _chunk_size, teacher_head_loss
from dflash.methods.dspark import (
    DSparkConfig,
    DSparkDrafter,
    DSparkProposer,
    objective,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def dspark_config(**overrides):
    base = small_config().__dict__ | dict(block_size=3, markov_rank=6, vocab_size=12, mask_token_id=11)
    return DSparkConfig(**(base | overrides))


def dspark_drafter(cfg, seed=0, scale=0.5):
    """A drafter with its Markov and confidence heads away from their start (W2 = 0), so that a slip shows."""
    torch.manual_seed(seed)
    model = DSparkDrafter(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "markov_head" in name or "confidence_head" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


# ---- the span layout: the anchor slot drafts


def test_span_layout_equals_index_loops():
    g = torch.Generator().manual_seed(0)
    R, T, B = 2, 30, 3
    S = B + 1
    input_ids = torch.randint(0, 50, (R, T), generator=g)
    position_ids = torch.arange(T).expand(R, T) + 5
    loss_mask = (torch.rand(R, T, generator=g) > 0.2).to(torch.uint8)
    doc_ids = torch.zeros(R, T, dtype=torch.int32)
    anchors, valid = blocks.sample_anchors(loss_mask, doc_ids, 6, S, torch.tensor(1))
    block_ids, q_pos, labels, weights = blocks.block_inputs(
        input_ids, position_ids, loss_mask, anchors, valid, 99, B, 4.0, S
    )
    assert block_ids.shape == q_pos.shape == (R, 6 * B) and labels.shape == weights.shape == (R, 6 * S)
    for r in range(R):
        for j, a in enumerate(anchors[r].tolist()):
            for k in range(B):
                assert block_ids[r, j * B + k] == (input_ids[r, a] if k == 0 else 99)
                assert q_pos[r, j * B + k] == position_ids[r, a] + k
            for k in range(S):
                assert labels[r, j * S + k] == input_ids[r, a + k]
                want = 0.0 if k == 0 else np.exp(-(k - 1) / 4.0) * float(loss_mask[r, a + k]) * bool(valid[r, j])
                assert abs(float(weights[r, j * S + k]) - want) < 1e-6
            # The whole span lies in the row: its last label is a + B.
            assert a + B < T
    hidden = torch.randn(R, 6 * B, 5, generator=g)
    laid = blocks.span_outputs(hidden, B, S)
    for j in range(6):
        assert torch.equal(laid[:, j * S], torch.zeros(R, 5))
        for k in range(1, S):  # output k - 1 (position a + k - 1) predicts the label at a + k
            assert torch.equal(laid[:, j * S + k], hidden[:, j * B + k - 1])
    values = torch.randn(R, T, 3, generator=g)
    gathered = blocks.span_gather(values, anchors, S, -1)
    for r in range(R):
        for j, a in enumerate(anchors[r].tolist()):
            for k in range(S):
                assert torch.equal(gathered[r, j * S + k], values[r, max(a + k - 1, 0)])


def test_dflash_layout_is_unchanged_by_the_span():
    g = torch.Generator().manual_seed(1)
    input_ids, loss_mask = torch.randint(0, 50, (1, 20), generator=g), torch.ones(1, 20, dtype=torch.uint8)
    anchors, valid = blocks.sample_anchors(loss_mask, torch.zeros(1, 20, dtype=torch.int32), 3, 4, torch.tensor(0))
    args = (input_ids, torch.arange(20)[None], loss_mask, anchors, valid, 7, 4, 2.0)
    for a, b in zip(blocks.block_inputs(*args), blocks.block_inputs(*args, 4)):
        assert torch.equal(a, b)
    assert blocks.span_outputs(torch.ones(1, 12, 2), 4, 4).shape == (1, 12, 2)


# ---- the loss


def teacher_of(kind, N, cfg, g, head):
    """A teacher per position and its full distribution [N, V] as the reference sees it (topk: the K + 1
    outcomes, the rest lumped)."""
    if kind == "hidden":
        final = torch.randn(N, cfg.hidden_size, generator=g, dtype=torch.float64)
        return {"teacher_hidden": final}, torch.softmax(final @ head.T, dim=-1)
    K = 4
    p = torch.softmax(torch.randn(N, cfg.vocab_size, generator=g, dtype=torch.float64) * 2, dim=-1)
    top = p.topk(K)
    teacher = {"teacher_ids": top.indices.int(), "teacher_probs": top.values, "teacher_tail": 1 - top.values.sum(-1)}
    return teacher, None


def distance_reference(p, kind, teacher, full):
    if kind == "hidden":
        return (p - full).abs().sum(-1)
    out = []
    for n in range(p.shape[0]):
        ids = teacher["teacher_ids"][n].long().tolist()
        inside = sum(abs(p[n, i] - teacher["teacher_probs"][n, c]) for c, i in enumerate(ids))
        rest = (1 - sum(p[n, i] for i in ids)) - teacher["teacher_tail"][n]
        out.append(inside + rest.abs())
    return torch.stack(out)


def objective_reference(model, hidden, head, labels, weights, S, kind, teacher, full, position_weights):
    markov = model.markov_head
    terms = []
    for n in range(hidden.shape[0]):
        previous = int(labels[n - 1])  # slot k's previous token is slot k - 1's label (slot 0, untrained, wraps)
        e = markov.markov_w1.weight[previous]
        z = head @ hidden[n] + markov.markov_w2.weight @ e
        terms.append((z, e))
    z = torch.stack([t[0] for t in terms])
    e = torch.stack([t[1] for t in terms])
    ce = F.cross_entropy(z, labels, reduction="none")
    p = torch.softmax(z, dim=-1)
    distance = distance_reference(p, kind, teacher, full)
    features = torch.cat([hidden, e], dim=-1)
    c = features @ model.confidence_head.proj.weight[0] + model.confidence_head.proj.bias[0]
    target = (1 - distance.detach() / 2).clamp(0, 1)
    bce = -(target * F.logsigmoid(c) + (1 - target) * F.logsigmoid(-c))
    w = weights if position_weights == "decay" else loss.dpace_weights(ce.detach(), weights > 0, S).double()
    total = (w * (0.1 * ce + 0.9 * distance + 1.0 * bce)).sum()
    correct = z.argmax(-1) == labels
    correct.view(-1, S)[:, 0] = False  # slot 0 (the anchor's own label) is never drafted
    return total, correct, ce, distance


# loss chunks cut to whole blocks of 3 (3, 15): D-PACE weighs a block at once; compiled as the trainer runs it
# (inductor, with graph.stored's row values) for D-PACE, whose weights are made from the chunk's CEs
CASES = [(k, p, c, False) for k in ("hidden", "topk") for p in ("decay", "dpace") for c in (4, 16)]
CASES += [("hidden", "dpace", 4, True), ("topk", "dpace", 4, True)]


@pytest.mark.parametrize("kind, position_weights, loss_chunk, compiled", CASES)
def test_objective_and_its_gradients_equal_the_float64_reference(kind, position_weights, loss_chunk, compiled):
    cfg = dspark_config()
    model = dspark_drafter(cfg, seed=2)
    S = cfg.span
    g = torch.Generator().manual_seed(3)
    N = 5 * S
    hidden = torch.randn(N, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    weights = torch.rand(N, generator=g, dtype=torch.float64) + 0.1
    weights.view(-1, S)[:, 0] = 0
    weights[6] = 0
    teacher, full = teacher_of(kind, N, cfg, g, head)
    options = ObjectiveOptions(position_weights=position_weights, loss_chunk=loss_chunk)
    objective_fn = torch.compile(objective, fullgraph=True) if compiled else objective
    got = objective_fn(model, hidden, head, labels, weights, S, options, teacher)
    got.loss_sum.backward()
    grads = {"hidden": hidden.grad.clone()} | {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    hidden.grad = None
    model.zero_grad()
    want, correct, _, _ = objective_reference(
        model, hidden, head, labels, weights, S, kind, teacher, full, position_weights
    )
    want.backward()
    torch.testing.assert_close(got.loss_sum, want)
    torch.testing.assert_close(got.position_loss.sum(), want.detach())
    assert torch.equal(got.correct, correct)
    torch.testing.assert_close(grads.pop("hidden"), hidden.grad)
    assert set(grads) == {n for n, p in model.named_parameters() if "markov" in n or "confidence" in n}
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize("kind", ["hidden", "topk"])
def test_the_mfu_formula_counts_the_objective_s_matmuls(kind):
    """dflash.drafter.flops.step_flops' terms for what the objective multiplies (the frozen LM head 2x, the Markov head
    3x through method_flops_per_token, the hidden teacher's head 1x) against the matmul FLOPs torch's
    FlopCounterMode counts in the objective's forward and backward. Without the confidence head: its per-row dot
    product runs elementwise (in float32 under autocast), which FlopCounterMode does not count."""
    cfg = dspark_config(enable_confidence_head=False)
    model = dspark_drafter(cfg, seed=4)
    S, anchors = cfg.span, 6
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(anchors * S, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    labels = torch.randint(0, cfg.vocab_size, (anchors * S,), generator=g)
    weights = torch.rand(anchors * S, generator=g, dtype=torch.float64) + 0.1  # every drafted row labelled
    teacher, _ = teacher_of(kind, anchors * S, cfg, g, head)
    with FlopCounterMode(display=False) as counter:
        objective(model, hidden, head, labels, weights, S, ObjectiveOptions(loss_chunk=8), teacher).loss_sum.backward()
    drafted = anchors * cfg.block_size
    teacher_rows = drafted if kind == "hidden" else 0
    loss_terms = step_flops(cfg, 0, drafted, drafted, 0, teacher_rows=teacher_rows) - step_flops(cfg, 0, drafted, 0, 0)
    assert counter.get_total_flops() == loss_terms + 3 * cfg.method_flops_per_token() * drafted


def test_markov_head_loss_terms_equal_the_reference_and_l1_is_twice_tv():
    cfg = dspark_config()
    g = torch.Generator().manual_seed(5)
    N = 9
    hidden = torch.randn(N, cfg.hidden_size, generator=g, dtype=torch.float64)
    previous = torch.randn(N, cfg.markov_rank, generator=g, dtype=torch.float64)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    w2 = torch.randn(cfg.vocab_size, cfg.markov_rank, generator=g, dtype=torch.float64)
    labels = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    weights = torch.rand(N, generator=g, dtype=torch.float64)
    teacher, full = teacher_of("hidden", N, cfg, g, head)
    got = teacher_head_loss(hidden, previous, head, w2, labels, weights, teacher, chunk_size=4)
    total, ce, distance, correct, w = got.total, got.ce, got.distance, got.correct, got.weight
    z = hidden @ head.T + previous @ w2.T
    p = torch.softmax(z, dim=-1)
    torch.testing.assert_close(ce, F.cross_entropy(z, labels, reduction="none"))
    tv = 1 - torch.minimum(p, full).sum(-1)  # speculators' form of the same distance
    torch.testing.assert_close(distance, 2 * tv)
    assert torch.equal(correct, z.argmax(-1) == labels)
    assert torch.equal(w, weights)
    torch.testing.assert_close(total, (weights * (0.1 * ce + 0.9 * distance)).sum())
    torch.testing.assert_close(got.terms, weights * (0.1 * ce + 0.9 * distance))


@pytest.mark.parametrize("compiled", [False, True])
def test_top_k_gradient_equals_autograd_of_the_reference_with_the_label_inside_and_outside_the_k(compiled):
    """The top-K path writes its gradient as one row-scaled pass plus K + 1 exact values; the label among the K
    (where both corrections meet) and outside them, each for half of the rows. Compiled too, as the trainer runs
    it: inductor then stores the row values (graph.stored) and scatters into the pass's own buffer."""
    cfg = dspark_config()
    g = torch.Generator().manual_seed(8)
    N = 10
    hidden = torch.randn(N, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    previous = torch.randn(N, cfg.markov_rank, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    w2 = torch.randn(cfg.vocab_size, cfg.markov_rank, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(N, generator=g, dtype=torch.float64) + 0.1
    teacher, _ = teacher_of("topk", N, cfg, g, head)
    ids = teacher["teacher_ids"].long()
    outside = [next(v for v in range(cfg.vocab_size) if v not in ids[n]) for n in range(N)]
    labels = torch.tensor([int(ids[n, n % 4]) if n % 2 else outside[n] for n in range(N)])
    loss_fn = torch.compile(teacher_head_loss, fullgraph=True) if compiled else teacher_head_loss
    total, *_ = loss_fn(hidden, previous, head, w2, labels, weights, teacher, chunk_size=4)
    got = torch.autograd.grad(total, (hidden, previous, w2))
    z = hidden @ head.T + previous @ w2.T
    ce = F.cross_entropy(z, labels, reduction="none")
    distance = distance_reference(torch.softmax(z, dim=-1), "topk", teacher, None)
    want_total = (weights * (0.1 * ce + 0.9 * distance)).sum()
    want = torch.autograd.grad(want_total, (hidden, previous, w2))
    torch.testing.assert_close(total, want_total)
    for name, a, b in zip(("hidden", "previous", "w2"), got, want, strict=True):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize(
    "rows, target, block", [(14336, 1024, 7), (14336, 1022, 7), (20, 4, 3), (15, 16, 3), (9, 1, 1)]
)
def test_loss_chunks_are_whole_blocks_of_even_size_within_the_target(rows, target, block):
    size = _chunk_size(rows, target, block)
    count = -(-rows // size)
    assert size % block == 0 and size <= max(block, target - target % block)
    assert count == -(-rows // max(block, target - target % block))  # no more chunks than the target's cut makes
    assert rows - (count - 1) * size > size - count * block  # even: the last is short by under a block per chunk


def test_without_a_teacher_the_objective_names_the_harvest_option():
    cfg = dspark_config()
    with pytest.raises(DflashError, match="--teacher"):
        objective(
            DSparkDrafter(cfg),
            torch.zeros(4, 32),
            torch.zeros(12, 32),
            torch.zeros(4),
            torch.ones(4),
            4,
            ObjectiveOptions(),
        )


# ---- decoding


class StubTarget:
    def __init__(self, embed, head):
        self.embed = torch.nn.Embedding.from_pretrained(embed)
        self.head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=head.dtype)
        with torch.no_grad():
            self.head.weight.copy_(head)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def proposer_setup(seed=0, cut=None):
    cfg = dspark_config(block_size=5)
    model = dspark_drafter(cfg, seed, scale=1.5)  # a Markov bias as strong as the logits: the walk changes drafts
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64) * 0.3
    target = StubTarget(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64), head)
    hidden = torch.randn(cfg.block_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    proposer = DSparkProposer(model, cfg, target, DecodingOptions(confidence_cut=cut))
    return cfg, model, proposer, head, hidden


def step_logits(model, head, h, previous):
    return head @ h + model.markov_head.markov_w2.weight @ model.markov_head.markov_w1.weight[previous]


def test_greedy_walk_equals_a_loop_and_differs_from_the_plain_head():
    cfg, model, proposer, head, hidden = proposer_setup()
    with torch.no_grad():
        draft = proposer.choose(hidden, torch.tensor(7), 0.0, None)
        previous, want = 7, []
        for h in hidden:
            previous = int(step_logits(model, head, h, previous).argmax())
            want.append(previous)
    assert draft.tokens.tolist() == want and draft.probs is None
    assert want != (hidden @ head.T).argmax(-1).tolist()


def test_sampled_walk_keeps_the_q_it_drew_from():
    cfg, model, proposer, head, hidden = proposer_setup(seed=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft = proposer.choose(hidden, torch.tensor(3), 0.8, generator)
        previous = 3
        for h, token, q in zip(hidden, draft.tokens.tolist(), draft.probs):
            torch.testing.assert_close(q.double(), torch.softmax(step_logits(model, head, h, previous) / 0.8, 0))
            previous = token


def test_the_confidence_cut_ends_where_the_running_product_drops_below_it():
    for cut in (0.05, 0.3, 0.6, 0.95):
        cfg, model, proposer, head, hidden = proposer_setup(seed=4, cut=cut)
        with torch.no_grad():
            draft = proposer.choose(hidden, torch.tensor(2), 0.0, None)
            previous, reach, want = 2, 1.0, 0
            proj = model.confidence_head.proj
            for j, h in enumerate(hidden):
                e = model.markov_head.markov_w1.weight[previous]
                reach *= float(torch.sigmoid(torch.cat([h, e]) @ proj.weight[0] + proj.bias[0]))
                if reach < cut and j > 0:
                    break
                previous = int(step_logits(model, head, h, previous).argmax())
                want += 1
        assert len(draft.tokens) == want
    with pytest.raises(DflashError, match="confidence"):
        proposer_setup(cut=1.5)


def test_speculative_sampling_with_the_markov_head_emits_the_target_distribution():
    cfg, model, proposer, head, hidden = proposer_setup(seed=2)
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.randn(4, cfg.vocab_size, generator=generator, dtype=torch.float64) * 2
    p = torch.softmax(p_logits[0], dim=0)
    trials, counts = 20000, torch.zeros(cfg.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(trials):
            draft = proposer.choose(hidden[:3], torch.tensor(3), 1.0, generator)
            accepted, bonus = accept_sampled(draft, target_probs(p_logits, 1.0), generator)
            counts[int(draft.tokens[0]) if accepted else bonus] += 1
    expected = p * trials
    often = expected >= 5
    observed = torch.cat([counts[often], counts[~often].sum()[None]])
    expected = torch.cat([expected[often], expected[~often].sum()[None]])
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum())
    dof = int(often.sum())
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    q = torch.softmax(step_logits(model, head, hidden[0], 3), 0)
    assert (q - p).abs().sum() > 0.3  # the drafter's q is far from p: the test has power


def test_config_round_trip_and_refusals():
    cfg = dspark_config(num_anchors=9, confidence_head_with_markov=False)
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["block_size"] == 3 and hf["markov_head_type"] == "vanilla"
    assert DSparkConfig.from_hf_config(hf) == cfg
    assert cfg.drafts_per_block == 3 and cfg.span == 4
    with pytest.raises(DflashError, match="markov_head_type"):
        DSparkConfig.from_hf_config(hf | {"markov_head_type": "rnn"})
    with pytest.raises(DflashError, match="markov_rank"):
        dspark_config(markov_rank=0)
    with pytest.raises(DflashError, match="sliding_window -1 leaves a block no context"):
        dspark_config(sliding_window=-1)
