"""DFlash 2 against independent references: the conv as the tap formula in loops (float64), the whole drafter as
the float64 reference of tests/test_drafter.py with those loops, the identity start as DFlash exactly, the
selector's edge scores, walk and training loss as brute-force float64 computations, and lossless sampling."""

import pytest
import torch
import torch.nn.functional as F
from test_drafter import (
    assert_inference_form_equals_training_form,
    conv_reference,
    make_drafter,
    reference_drafter,
    small_config,
    training_batch,
)
from test_dspark import distance_reference, teacher_of
from torch.nn.attention.flex_attention import create_mask

from dflash.drafter import loss
from dflash.drafter.blocks import block_attention_mask, dense_block_mask
from dflash.errors import DflashError
from dflash.evaluate.decoding import accept_sampled, draft_overlap, target_probs
from dflash.methods import ObjectiveOptions
from dflash.methods.dflash2 import (
    DFlash2Config,
    DFlash2Drafter,
    DFlash2Proposer,
    DynamicBlockConv,
    objective,
    selector_distance,
    selector_targets,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def dflash2_config(**overrides):
    base = small_config().__dict__ | dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    base |= dict(sliding_window=None, input_embedding_scale=1.5)
    return DFlash2Config(**(base | overrides))


def randomise(model, seed=0, scale=0.3):
    """Every DFlash 2 parameter away from its identity start, so that a wrong tap, group or side shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def dflash2_drafter(cfg, seed=0, scale=0.3):
    torch.manual_seed(seed)
    return randomise(DFlash2Drafter(cfg).double(), seed, scale)


def test_conv_equals_the_tap_formula():
    cfg = dflash2_config(block_size=4)
    conv = randomise(DynamicBlockConv(cfg).double())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, cfg.hidden_size, generator=g, dtype=torch.float64)  # three blocks per row
    y = torch.randn_like(x)
    prepared, dynamic = conv.prepare(x)
    weights = conv.base_kernel.detach(), conv.kernel_projection.weight.detach()
    torch.testing.assert_close(prepared, conv_reference(x, x, *weights, 0, 4, cfg.conv_group_size))
    finished = conv.finish(y, dynamic)
    torch.testing.assert_close(finished, conv_reference(y, x, *weights, 1, 4, cfg.conv_group_size))
    # No tap crosses a block: a block's outputs do not change with the previous block's inputs.
    x2 = x.clone()
    x2[:, 4:8] += 1.0
    assert torch.equal(conv.prepare(x2)[0][:, 8:], prepared[:, 8:])


@pytest.mark.parametrize("window", [None, 9])
def test_drafter_equals_the_float64_reference(window):
    cfg = dflash2_config(sliding_window=window)
    model = dflash2_drafter(cfg)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    visible = dense_block_mask(anchors, valid, doc_ids, cfg.block_size, window)
    out = model(embeds, features, q_pos, ctx_pos, block_attention_mask(anchors, valid, doc_ids, cfg.block_size, window))
    params = {k: v.detach() for k, v in model.state_dict().items()}
    torch.testing.assert_close(out, reference_drafter(params, cfg, embeds, features, q_pos, ctx_pos, visible))


def test_the_windowed_block_mask_equals_the_dense_rule():
    cfg = small_config()
    _, _, _, _, anchors, valid, doc_ids = training_batch(cfg)
    R, A = anchors.shape
    for window in (1, 5, 30):
        mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size, window)
        Q = A * cfg.block_size
        dense = create_mask(mask.mask_mod, R, 1, Q, doc_ids.shape[1] + Q, device="cpu")[:, 0]
        want = dense_block_mask(anchors, valid, doc_ids, cfg.block_size, window)
        assert torch.equal(dense, want)
        # A query at a + k sees exactly the context positions a + k - window < kv < a.
        context = want[0, :, : doc_ids.shape[1]]
        for q in range(Q):
            a, k = int(anchors[0, q // cfg.block_size]), q % cfg.block_size
            seen = context[q].nonzero().flatten().tolist()
            if valid[0, q // cfg.block_size] and seen:
                assert seen[0] >= a + k - window + 1 and seen[-1] == a - 1


@pytest.mark.parametrize("window", [None, 6])
def test_inference_form_equals_training_form_with_one_anchor_at_the_end(window):
    cfg = dflash2_config(sliding_window=window)
    assert_inference_form_equals_training_form(dflash2_drafter(cfg, seed=2), cfg)


def test_identity_start_is_the_dflash_drafter_exactly():
    cfg = dflash2_config(input_embedding_scale=1.0)
    v1 = make_drafter(small_config())
    torch.manual_seed(5)
    v2 = DFlash2Drafter(cfg).double()
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    assert torch.equal(v2(embeds, features, q_pos, ctx_pos, mask), v1(embeds, features, q_pos, ctx_pos, mask))


def test_config_checks_and_round_trip():
    cfg = dflash2_config()
    assert DFlash2Config.from_hf_config(cfg.to_hf_config()) == cfg
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["is_causal"] is False
    with pytest.raises(DflashError, match="divid"):
        dflash2_config(conv_group_size=5)
    with pytest.raises(DflashError, match="selector_top_k"):
        dflash2_config(selector_top_k=0)
    with pytest.raises(DflashError, match="exceeds block_size 4"):
        dflash2_config(conv_kernel_size=5, block_size=4)
    with pytest.raises(DflashError, match="sliding_window 0 leaves a block no context"):
        dflash2_config(sliding_window=0)  # the base config's check, through DFlash 2's own
    with pytest.raises(DflashError, match="sliding_window 8 is below block_size 16.*sliding_window=16 or more"):
        dflash2_config(sliding_window=8, block_size=16)  # z-lab's reference agrees on 53 of 360 tokens there
    assert dflash2_config(sliding_window=16, block_size=16).sliding_window == 16


# ---- the selector


def brute_force_scores(selector, hidden, unary_row, previous, candidates):
    """S(p -> c) for one slot, each candidate's sum over the rank written out in float64."""
    A, Bk = selector.predecessor_codebook.double(), selector.successor_codebook.double()
    ph = selector.hidden_projection.weight.double() @ hidden.double()
    return torch.tensor(
        [
            float(unary_row[c]) + sum(float(A[previous, r] * ph[r] * Bk[c, r]) for r in range(A.shape[1]))
            for c in candidates.tolist()
        ],
        dtype=torch.float64,
    )


class Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight.T


class StubTarget:
    def __init__(self, embed, head):
        self.embed, self.head = torch.nn.Embedding.from_pretrained(embed), Head(head)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def selector_setup(seed=0, output_multiplier=0.7):
    cfg = dflash2_config(output_multiplier=output_multiplier)
    model = dflash2_drafter(cfg, seed, scale=1.5)  # edges as strong as the unary logits: the walk changes drafts
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    target = StubTarget(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64), head)
    hidden = torch.randn(cfg.block_size - 1, cfg.hidden_size, generator=g, dtype=torch.float64)
    return cfg, model, DFlash2Proposer(model, cfg, target), head, hidden


def test_greedy_walk_equals_a_brute_force_walk():
    cfg, model, proposer, head, hidden = selector_setup()
    anchor = torch.tensor(7)
    with torch.no_grad():
        draft = proposer.choose(hidden, anchor, 0.0, None)
        previous, want = 7, []
        for slot in range(hidden.shape[0]):
            unary = (hidden[slot] * cfg.output_multiplier) @ head.T
            candidates = unary.topk(cfg.selector_top_k).indices
            scores = brute_force_scores(model.candidate_selector, hidden[slot], unary, previous, candidates)
            previous = int(candidates[scores.argmax()])
            want.append(previous)
    assert draft.tokens.tolist() == want and draft.probs is None
    # The walk differs from the LM head's argmax somewhere, or this test would not see the selector at all.
    assert want != ((hidden * cfg.output_multiplier) @ head.T).argmax(-1).tolist()


def test_sampled_walk_keeps_the_k_way_q_it_drew_from():
    cfg, model, proposer, head, hidden = selector_setup(seed=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft = proposer.choose(hidden, torch.tensor(3), 0.8, generator)
        previous = 3
        for slot, token in enumerate(draft.tokens.tolist()):
            unary = (hidden[slot] * cfg.output_multiplier) @ head.T
            candidates = unary.topk(cfg.selector_top_k).indices
            scores = brute_force_scores(model.candidate_selector, hidden[slot], unary, previous, candidates)
            want = torch.zeros(cfg.vocab_size, dtype=torch.float64)
            want[candidates] = torch.softmax(scores / 0.8, dim=0)
            torch.testing.assert_close(draft.probs[slot].double(), want, rtol=1e-5, atol=1e-7)
            assert token in candidates.tolist()
            previous = token


def test_speculative_sampling_with_the_selector_emits_the_target_distribution():
    """Chi-square test on a tiny vocabulary: whatever the selector's q, the first committed token follows p."""
    cfg, model, proposer, head, hidden = selector_setup(seed=2)
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.randn(hidden.shape[0] + 1, cfg.vocab_size, generator=generator, dtype=torch.float64) * 2
    p = torch.softmax(p_logits[0], dim=0)
    trials, counts = 20000, torch.zeros(cfg.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(trials):
            draft = proposer.choose(hidden[:3], torch.tensor(3), 1.0, generator)
            accepted, bonus = accept_sampled(draft, target_probs(p_logits[:4], 1.0), generator)
            counts[int(draft.tokens[0]) if accepted else bonus] += 1
    expected = p * trials
    often = expected >= 5  # pool the rare tokens into one cell, as the test requires
    observed = torch.cat([counts[often], counts[~often].sum()[None]])
    expected = torch.cat([expected[often], expected[~often].sum()[None]])
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum())
    dof = int(often.sum())  # cells - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)  # about 3 sigma above the mean of chi2(dof)
    # And the test has power: the drafter's own first-token distribution is far from p.
    q_counts = torch.zeros(cfg.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(2000):
            q_counts[int(proposer.choose(hidden[:1], torch.tensor(3), 1.0, generator).tokens[0])] += 1
    assert (q_counts / 2000 - p).abs().sum() > 0.3


def test_draft_overlap_is_the_acceptance_chance_of_each_k_way_draft():
    """draft_overlap's sum min(p, q) against a float64 loop, and against the frequency with which speculative
    sampling accepts the first draft of the selector's K-way q."""
    cfg, model, proposer, head, hidden = selector_setup(seed=2)
    generator = torch.Generator().manual_seed(1)
    p_logits = torch.randn(4, cfg.vocab_size, generator=generator, dtype=torch.float64) * 2
    with torch.no_grad():
        draft = proposer.choose(hidden[:3], torch.tensor(3), 0.7, generator)
    p = torch.softmax(p_logits / 0.7, dim=-1)
    want = [sum(min(float(p[i, v]), float(draft.probs[i, v])) for v in range(cfg.vocab_size)) for i in range(3)]
    support = [float(p[i, draft.probs[i] > 0].sum()) for i in range(3)]
    on = [[v for v in range(cfg.vocab_size) if draft.probs[i, v] > 0] for i in range(3)]
    shape = [sum(min(float(p[i, v]) / support[i], float(draft.probs[i, v])) for v in on[i]) for i in range(3)]
    got = draft_overlap(draft, target_probs(p_logits, 0.7))
    torch.testing.assert_close(got, torch.tensor([want, support, shape], dtype=got.dtype).T)
    assert all(o <= m + 1e-6 < 1 for o, m in zip(want, support))  # capped by the K candidates' mass under 1
    assert all(o >= m * f - 1e-6 for o, m, f in zip(want, support, shape))  # at least cap x shape
    trials, accepted = 4000, 0
    with torch.no_grad():
        for _ in range(trials):
            draft = proposer.choose(hidden[:1], torch.tensor(3), 0.7, generator)
            accepted += accept_sampled(draft, target_probs(p_logits[:2], 0.7), generator)[0]
    assert abs(accepted / trials - want[0]) < 4 * (want[0] * (1 - want[0]) / trials) ** 0.5


# ---- the training objective


def teacher_prob(teacher, full, n, token):
    """The target's p of one token as the selector's distance reads it (a top-k teacher: 0 off its K tokens)."""
    if full is not None:
        return full[n, token]
    ids = teacher["teacher_ids"][n].long().tolist()
    return teacher["teacher_probs"][n, ids.index(token)] if token in ids else torch.tensor(0.0, dtype=torch.float64)


def objective_reference(model, hidden, head, labels, weights, B, kind, outside, alpha, teacher=None, full=None):
    """The loss from full float64 logits, candidates and edge scores as brute-force loops; with a teacher, each CE
    becomes 0.1 CE + 0.9 L1 to the target's distribution (the selector's over its K candidates and the rest)."""
    cfg = model.config
    unary = (hidden * cfg.output_multiplier) @ head.T
    ce = F.cross_entropy(unary, labels, reduction="none")
    w = weights if kind == "decay" else loss.dpace_weights(ce.detach(), weights > 0, B).double()
    if teacher is None:
        total = (w * ce).sum()
    else:
        distance = distance_reference(
            torch.softmax(unary, dim=-1), "hidden" if full is not None else "topk", teacher, full
        )
        total = (w * (0.1 * ce + 0.9 * distance)).sum()
    selector = model.candidate_selector
    gate = selector.predecessor_codebook[labels.roll(1)] * selector.hidden_projection(hidden)
    correct = []
    for n in range(hidden.shape[0]):
        candidates = unary[n].detach().topk(cfg.selector_top_k).indices.tolist()
        inside = int(labels[n]) in candidates
        if not inside and outside == "replace":
            candidates[-1] = int(labels[n])
        scores = torch.stack([unary[n, c] + (gate[n] * selector.successor_codebook[c]).sum() for c in candidates])
        if inside or outside == "replace":
            target = candidates.index(int(labels[n]))
            term = scores.logsumexp(0) - scores[target]
            if teacher is not None:
                p = torch.stack([teacher_prob(teacher, full, n, c) for c in candidates])
                l1 = (torch.softmax(scores, 0) - p).abs().sum() + (1 - p.sum())
                term = 0.1 * term + 0.9 * l1
            total = total + alpha * w[n] * term
        correct.append(inside and int(scores.argmax()) == candidates.index(int(labels[n])))
    correct = torch.tensor(correct)
    correct.view(-1, B)[:, 0] = False  # slot 0 (the anchor) is never drafted
    return total, correct


@pytest.mark.parametrize("kind", ["decay", "dpace"])
@pytest.mark.parametrize("outside", ["replace", "drop"])
@pytest.mark.parametrize("source", [None, "topk", "hidden"])
def test_objective_and_its_gradients_equal_the_float64_reference(kind, outside, source):
    """On hard labels, and against the target's distribution from each kind of teacher store (the unary and the
    selector's K-way terms): value and gradients of hidden and every selector parameter against brute-force float64
    loops, with the label outside the top K at some positions."""
    B = 4
    cfg = dflash2_config(block_size=B, output_multiplier=0.8, selector_top_k=3, vocab_size=12, mask_token_id=11)
    model = dflash2_drafter(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    N = 6 * B
    hidden = torch.randn(N, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=torch.float64)
    labels = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    weights = torch.rand(N, generator=g, dtype=torch.float64) + 0.1
    weights.view(-1, B)[:, 0] = 0  # the anchor slot
    weights[5] = 0  # an untrained position
    teacher, full = teacher_of(source, N, cfg, g, head) if source else (None, None)
    options = ObjectiveOptions(position_weights=kind, loss_chunk=8, selector_weight=0.7, selector_outside=outside)
    got = objective(model, hidden, head, labels, weights, B, options, teacher)
    got.loss_sum.backward()
    grads = {"hidden": hidden.grad.clone()} | {
        n: p.grad.clone() for n, p in model.candidate_selector.named_parameters()
    }
    hidden.grad = None
    model.zero_grad()
    # The store's teacher sits at every position, the anchor slot's included; the objective drops that slot.
    want, correct = objective_reference(model, hidden, head, labels, weights, B, kind, outside, 0.7, teacher, full)
    want.backward()
    torch.testing.assert_close(got.loss_sum, want)
    torch.testing.assert_close(got.position_loss.sum(), want.detach())
    assert torch.equal(got.correct, correct)
    torch.testing.assert_close(grads["hidden"], hidden.grad)
    for name, p in model.candidate_selector.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    # Some label sits outside the top K, so the two ways of handling it were both exercised.
    assert not selector_targets(torch.topk((hidden.detach() * 0.8) @ head.T, 3).indices, labels, outside)[2].all()


def test_the_selector_distance_is_twice_the_rejection_chance_of_its_k_way_draft():
    """L1 over the K candidates and the rest = 2 (1 - sum_c min(p_c, q_c)): twice the chance that speculative
    sampling rejects a token drawn from q, which an exact count over the vocabulary gives."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 4, generator=g, dtype=torch.float64)
    p_full = torch.softmax(torch.randn(5, 9, generator=g, dtype=torch.float64), dim=-1)
    candidates = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(5)])
    p = p_full.gather(1, candidates)
    q = torch.softmax(scores, dim=-1)
    rejection = 1 - torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(selector_distance(scores, p), 2 * rejection)


def test_the_compiled_selector_backward_is_bit_repeatable_on_two_cpu_threads():
    """Many rows gathering the same codebook rows: inductor's threaded CPU code accumulates their gradients with
    atomic adds (repeats differed in the last bits, so a CPU run's exact resume did not hold); the trainer's
    init_distributed switches the CPU to deterministic kernels, under which four repeats agree bit for bit."""
    from dflash.train.setup import init_distributed

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    try:
        init_distributed("cpu")
        cfg = dflash2_config(vocab_size=4096, mask_token_id=4095, selector_rank=32, selector_top_k=16)
        selector = dflash2_drafter(cfg).float().candidate_selector
        g = torch.Generator().manual_seed(0)
        N = 4096
        hidden = torch.randn(N, cfg.hidden_size, generator=g)
        unary = torch.randn(N, 16, generator=g)
        previous, candidates = torch.randint(0, 50, (N,), generator=g), torch.randint(0, 200, (N, 16), generator=g)
        scores = torch.compile(selector.edge_scores)
        grads = []
        for _ in range(4):
            selector.zero_grad()
            scores(hidden, unary, previous, candidates).logsumexp(-1).sum().backward()
            grads.append([p.grad.clone() for p in selector.parameters()])
        assert all(torch.equal(a, b) for again in grads[1:] for a, b in zip(grads[0], again, strict=True))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def test_training_refuses_a_softcap():
    cfg = dflash2_config(final_logit_softcapping=30.0)
    model = DFlash2Drafter(cfg)
    with pytest.raises(DflashError, match="softcapping"):
        objective(
            model,
            torch.zeros(4, cfg.hidden_size),
            torch.zeros(cfg.vocab_size, cfg.hidden_size),
            torch.zeros(4, dtype=torch.long),
            torch.ones(4),
            cfg.block_size,
            ObjectiveOptions(),
        )


def test_the_torch_free_option_lists_name_the_registered_methods_and_weights():
    from dflash import config, methods

    assert list(config.DRAFTER_METHODS) == list(methods.METHODS)
    assert list(config.POSITION_WEIGHTS) == list(loss.POSITION_WEIGHTS)
    assert config.TrainConfig.method in methods.METHODS
    with pytest.raises(DflashError, match="--method nope"):
        config.TrainConfig(store="s", out="o", method="nope")
