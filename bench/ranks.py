"""bench/train.py under torchrun: each rank's view of the run, the ranks gathered on rank 0, their aggregate, the
weights compared across ranks, and the scaling against a one-GPU run."""

import torch
import torch.distributed as dist

from dflash.train import Trainer
from dflash.train.setup import Env


def replica_check(trainer: Trainer) -> dict:
    """This rank's trainable fp32 weights against rank 0's (broadcast one tensor at a time, so no flat copy of
    all of them is needed): the max abs difference, and a float64 checksum of the weights."""
    diff = torch.zeros((), dtype=torch.float32, device=trainer.device)
    for p in trainer.params:
        reference = p.detach().clone()
        if trainer.env.world_size > 1:
            dist.broadcast(reference, 0)
        diff = torch.maximum(diff, (p.detach() - reference).abs().max())
    checksum = sum(p.detach().sum(dtype=torch.float64) for p in trainer.params)
    return {"weights_max_abs_diff": diff.item(), "weights_checksum": checksum.item()}


RANK_KEYS = (
    "mfu",
    "step_ms",
    "data_wait",
    "peak_allocated_GB",
    "peak_reserved_GB",
    "allocated_spread",
    "reserved_spread",
)


def rank_summary(summary: dict, env: Env, weights: dict) -> dict:
    """This rank's numbers. The records' rates count the tokens of all ranks; every row of the store holds the
    same context tokens, so this rank's share is 1/world of them (over this rank's time)."""
    u = summary["ungraphed"]
    return {
        "rank": env.rank,
        "context_tok_s": summary["context_tok_s"] / env.world_size,
        **{key: summary.get(key) for key in RANK_KEYS},
        "recompiles": summary["recompiles"] + u.get("recompiles", 0),
        "ungraphed_step_ms": u.get("step_ms"),
        **weights,
    }


def gather_ranks(mine: dict, env: Env) -> list[dict]:
    if env.world_size == 1:
        return [mine]
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    return ranks


# All ranks together: the worst rank's value of each of these (MFU is averaged instead).
WORST_KEYS = (*(key for key in RANK_KEYS if key != "mfu"), "ungraphed_step_ms", "weights_max_abs_diff")


def worst(ranks: list[dict], key: str):
    values = [r[key] for r in ranks if r[key] is not None]
    return max(values) if values else None


def aggregate(ranks: list[dict]) -> dict:
    """All ranks together: the total context rate and the per-GPU means; the worst rank for everything else."""
    n, total = len(ranks), sum(r["context_tok_s"] for r in ranks)
    mfu = [r["mfu"] for r in ranks if r["mfu"] is not None]
    return {
        "world_size": n,
        "context_tok_s": total,
        "context_tok_s_per_gpu": total / n,
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "recompiles": sum(r["recompiles"] for r in ranks),
        **{key: worst(ranks, key) for key in WORST_KEYS},
        "weights_checksums_equal": len({r["weights_checksum"] for r in ranks}) == 1,
    }


def scaling(result: dict, baseline: dict, path: str) -> dict:
    """Per-GPU throughput and MFU at this run's ranks against the one-GPU run of the same drafter in `baseline`."""
    same = ("drafter", "shape", "row", "loss_chunk")
    matches = [r for r in baseline["results"] if "error" not in r and all(r[k] == result[k] for k in same)]
    if not matches:
        return {"error": f"{path} has no one-GPU result of drafter {result['drafter']} with these shapes"}
    one, agg = matches[0], result["aggregate"]
    has_mfu = agg["mfu"] is not None and one["mfu"] is not None
    return {
        "baseline": path,
        "world_size": agg["world_size"],
        "per_gpu_context_tok_s": agg["context_tok_s_per_gpu"],
        "one_gpu_context_tok_s": one["context_tok_s"],
        "efficiency": agg["context_tok_s_per_gpu"] / one["context_tok_s"],
        "mfu_per_gpu": agg["mfu"],
        "one_gpu_mfu": one["mfu"],
        "mfu_ratio": agg["mfu"] / one["mfu"] if has_mfu else None,
    }


def rank_view(summary: dict, trainer: Trainer, baseline: dict | None, path: str | None) -> dict:
    """Every rank's row, their aggregate and, given a one-GPU baseline, the scaling (collectives: all ranks)."""
    env = trainer.env
    ranks = gather_ranks(rank_summary(summary, env, replica_check(trainer)), env)
    view = {"ranks": ranks, "aggregate": aggregate(ranks)}
    if baseline is not None:
        view["scaling"] = scaling({**summary, **view}, baseline, path)
    return view
