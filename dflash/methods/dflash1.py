"""DFlash as the paper of February 2026 describes it: the backbone of dflash.drafter.model, the block CE through the
target's LM head, drafts by argmax (or sampling) of those logits."""

from dflash.drafter import DFlashDrafter, DrafterConfig, loss
from dflash.drafter.proposers import DFlashProposer
from dflash.methods.base import Method, Objective, drafted_slots, with_slot0


def objective(model, hidden, head, labels, weights, block_size, options, teacher=None) -> Objective:
    """The block CE of the LM head's logits under the chosen position weights; drafts are its argmax."""
    hidden, labels, weights = (drafted_slots(t, block_size) for t in (hidden, labels, weights))
    ce, correct, _ = loss.head_cross_entropy(hidden, head, labels, options.loss_chunk)
    terms = loss.position_weights(options.position_weights, ce, weights, block_size - 1) * ce
    return Objective(terms.sum(), with_slot0(terms.detach(), block_size), with_slot0(correct, block_size))


METHOD = Method(
    name="dflash",
    config_cls=DrafterConfig,
    model_cls=DFlashDrafter,
    proposer_cls=DFlashProposer,
    objective_fn=objective,
)
