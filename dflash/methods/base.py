"""What a drafter method is: its config and model classes, its training objective and its decoding proposer.

The store, the reader, the captured step, the checkpointer and the metrics are shared by every method and know
nothing of it: the trainer calls `Method.objective_fn` on the drafter's final-normed block outputs, evaluation builds
`Method.proposer_cls`, export and loading go through the config class (`to_hf_config`, `checkpoint_keys`).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ObjectiveOptions:
    """The training options an objective reads (from TrainConfig)."""

    position_weights: str = "decay"  # loss.POSITION_WEIGHTS
    loss_chunk: int | None = None
    selector_weight: float = 1.0  # DFlash 2: the selector CE's weight beside the unary CE
    selector_outside: str = "replace"  # DFlash 2: a true token outside the top-K replaces the K-th candidate, or "drop"


class Objective(NamedTuple):
    """One micro-batch's loss terms and what the shared metrics read."""

    loss_sum: Tensor  # [] the weighted sum of the loss terms; the trainer divides it by the global normaliser
    position_loss: Tensor  # [N] each position's share of loss_sum (no gradient), for the per-source metrics
    correct: Tensor  # [N] bool: the method's temperature-0 decoding, teacher-forced, drafts the label here


def drafted_slots(values: Tensor, span: int) -> Tensor:
    """[A * span, ...] -> [A * (span - 1), ...]: slot 0 of every span dropped. It holds the anchor's own token (a
    DFlash block's input, DSpark's anchor label) and is never trained, so the LM head and the loss need not see it:
    1 / span of their rows."""
    return values.unflatten(0, (-1, span))[:, 1:].flatten(0, 1)


def with_slot0(values: Tensor, span: int) -> Tensor:
    """drafted_slots' inverse for per-position results [A * (span - 1)] -> [A * span], slot 0 zero (False)."""
    return F.pad(values.view(-1, span - 1), (1, 0)).flatten()


@dataclass(frozen=True)
class Method:
    name: str  # --method
    config_cls: type  # a dflash.drafter.model.DrafterConfig
    model_cls: type  # a dflash.drafter.model.DFlashDrafter
    proposer_cls: type  # a dflash.drafter.proposers.DFlashProposer: (model, config, target)
    # (model, hidden [N, H], head [V, H], labels [N], weights [N], span, ObjectiveOptions, teacher) -> Objective;
    # N = A * span positions in block-major order (DrafterConfig.span), teacher: the store's teacher arrays at the
    # position before each label ({name: [N, ...]}), or None for a method that does not read them
    objective_fn: object
    # Whether it trains against the target's next-token distribution (a store harvested with --teacher): "none",
    # "optional" (when the store holds one and TrainConfig.teacher_loss is auto) or "required"
    teacher: str = "none"
