"""The drafter: its model, the attention kernels and blocks of its training step, and what that step costs.

The modules: `model` (the DFlash backbone and `DrafterConfig`, the base every method's model extends), `blocks`
(anchors, block inputs / labels / weights, the BlockMask), `attention` (which flex_attention kernels a CUDA step
runs), `loss` (the block cross-entropy through the frozen LM head), `graph` (compile and CUDA-graph capture of a
step), `memory` (a step's estimated peak memory), `flops` (a step's counted FLOPs), `step_time` (a step's time
on one H200), `proposers` (what drafts a speculative round). Nothing here imports the stages that use a drafter
(train, evaluate, harvest, plan) or the methods that extend it.
"""

from dflash.drafter.model import (  # noqa: F401  (re-exported: dflash.drafter is where callers find them)
    DFlashDrafter,
    DrafterConfig,
    flash_kv_repeat,
    heads_at_head_dim,
    rope_theta_of,
)
