"""The DFlash trainer: one process per device, one compiled and CUDA-graphed step, rows streamed from the store.

    run_training(cfg)
      Trainer.__init__   store, drafter, frozen embedding / LM head, static buffers, optimizer, data plan
      Trainer.prepare    warmup + capture on synthetic rows, restore the initial (or checkpointed) state
      Trainer.fit        feed -> replay -> metrics / checkpoints, then validation and export

Everything a step does happens on the device inside `_train_step` (captured once, replayed every step). The
host only copies the next rows into the static buffers and, on log steps, reads the metric accumulators: the
hot loop has no host synchronisation and allocates nothing. Formulas (MFU, metrics) and resume semantics are
documented in docs/training.md.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dflash import blocks, graph, loss, reader
from dflash.drafter import DFlashDrafter, DrafterConfig, export_drafter
from dflash.errors import DflashError, describe_differences
from dflash.target import MASK_TOKEN, load_config, load_embedding_and_head, local_device

logger = logging.getLogger("dflash")

ANCHORS_PER_3072 = 512  # the paper: 512 anchors per 3072-token sequence; scaled with the token budget


@dataclass
class TrainConfig:
    shards: str
    out: str
    target: str | None = None  # embedding / LM-head checkpoint; default: the target recorded in the store
    # drafter
    draft_layers: int = 5
    block_size: int = 16
    drafter_overrides: dict = field(default_factory=dict)  # other DrafterConfig fields, e.g. intermediate_size
    # step
    anchors: int | None = None  # per row; None: 512 per 3072 tokens of the store's token budget
    gamma: float | None = None  # loss decay; None: 7 for B=16, 5 for 10, 4 for 8 (the paper)
    rows_per_step: int = 1  # rows per micro-step on each rank
    grad_accum: int = 1  # micro-steps per optimizer step
    loss_chunk: int | None = None  # rows of logits alive at once in the loss; None: loss.default_chunk_size
    # optimizer and schedule (the paper's defaults; betas / weight decay are torch's AdamW defaults)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None  # overrides epochs when set
    seed: int = 0
    # data
    val_fraction: float = 0.01
    val_shards: str | None = None  # a held-out store (other documents, same target and rows); replaces val_fraction
    prefetch: int = 2  # steps read ahead
    reader_workers: int = 4
    # run
    log_every: int = 10
    ckpt_every: int = 1000
    val_every: int = 0  # 0: validate once, at the end
    resume: bool = False
    export: bool = True
    export_dtype: str = "bfloat16"
    # execution
    device: str | None = None  # default: cuda:LOCAL_RANK when CUDA is there, else cpu
    compile: bool | None = None  # default: on for CUDA (see graph.py), off on the CPU
    cuda_graph: bool = True
    peak_tflops: float = 792.0  # dense bf16 rate of the device, the MFU denominator (H200, measured)
    tensorboard: bool = True


# Options that may differ between a run and its resumption: they change how the run executes or reports, not
# the sequence of weights it computes.
RESUMABLE_CHANGES = {
    "out", "shards", "target", "log_every", "ckpt_every", "val_every", "resume", "export", "export_dtype",
    "device", "compile", "cuda_graph", "peak_tflops", "tensorboard", "prefetch", "reader_workers",
}  # fmt: skip


POSITIVE = (
    "draft_layers", "rows_per_step", "grad_accum", "loss_chunk", "epochs", "log_every", "ckpt_every", "prefetch",
    "reader_workers", "max_steps", "anchors",
)  # fmt: skip


def check_config(cfg: TrainConfig):
    """Option values that are wrong whatever the store: one message per run, naming the flags."""
    values = {name: getattr(cfg, name) for name in POSITIVE}
    bad = [f"--{k.replace('_', '-')} {v} (must be at least 1)" for k, v in values.items() if v is not None and v < 1]
    if not 0 <= cfg.val_fraction < 1:
        bad.append(f"--val-fraction {cfg.val_fraction} (must be in [0, 1))")
    if not 0 <= cfg.warmup_ratio <= 1:
        bad.append(f"--warmup-ratio {cfg.warmup_ratio} (must be in [0, 1])")
    if cfg.lr <= 0 or cfg.clip <= 0 or (cfg.gamma is not None and cfg.gamma <= 0):
        bad.append("--lr, --clip and --gamma must be positive")
    if cfg.export_dtype not in ("bfloat16", "float32"):
        bad.append(f"--export-dtype {cfg.export_dtype} (bfloat16 or float32)")
    if bad:
        raise DflashError(f"invalid options: {'; '.join(bad)}")


VAL_STORE_FIELDS = ("layer_ids", "feature_dim", "token_budget", "tokenizer")


def check_val_store(train: dict, val: dict, train_path: str, path: str) -> None:
    """A held-out store is read into the training rows' buffers and scored against the same target: it must share
    the target (its config and the dtype it ran in), the tapped layers, the tokenizer and the row layout of the
    training store. Weights are not compared: a fine-tune with the same config passes."""
    if Path(path).resolve() == Path(train_path).resolve():
        raise DflashError(f"--val-shards {path} is the training store itself; give a store of held-out documents")
    differ = [name for name in VAL_STORE_FIELDS if train.get(name) != val.get(name)]
    if train["target"].get("config_hash") != val["target"].get("config_hash"):
        differ.append("target (config hash)")
    if train["fingerprint"].get("dtype") != val["fingerprint"].get("dtype"):
        differ.append("the dtype the target ran in")
    if differ:
        raise DflashError(
            f"the held-out store {path} differs from the training store in {', '.join(differ)}; harvest the "
            "held-out documents with the same --model, --layers and --token-budget"
        )


def fingerprint(cfg: TrainConfig, world: int) -> dict:
    """The options a resumed run must share with its checkpoint (JSON-normalised), and the number of ranks.

    Where the held-out store lives does not change the weights; whether there is one does (without it, a fraction
    of the rows is held out). Checkpoints from before --val-shards have no such key: None, as for no store."""
    options = json.loads(json.dumps(dataclasses.asdict(cfg)))
    if cfg.val_shards:
        options.update(val_shards=True, val_fraction=None)
    return {**{k: v for k, v in options.items() if k not in RESUMABLE_CHANGES}, "world_size": world}


# ---------------------------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class Env:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None) -> Env:
    """One process per device under torchrun (RANK / WORLD_SIZE / LOCAL_RANK); NCCL on CUDA, gloo on the CPU."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = local_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)
    return Env(rank, world, dev)


# ---------------------------------------------------------------------------------------------- schedule


def learning_rate(step: torch.Tensor, cfg: TrainConfig, total_steps: int) -> torch.Tensor:
    """Linear warmup then cosine to min_lr_ratio * lr, as device tensor ops on the step counter (graph-safe)."""
    warmup = max(1, round(cfg.warmup_ratio * total_steps))
    s = step.float()
    warm = (s + 1) / warmup
    progress = ((s - warmup) / max(1, total_steps - warmup)).clamp(0, 1)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
    return cfg.lr * torch.where(s < warmup, warm, cosine)


# ---------------------------------------------------------------------------------------------- data plan


def _row_keys(seed: int, epoch: int, rows: np.ndarray) -> np.ndarray:
    """Per-row anchor seeds: a function of (seed, epoch, row) only, so anchors do not depend on which rank or
    batch slot a row lands in (one process and N ranks draw the same anchors for the same row)."""
    mix = np.random.SeedSequence([seed, epoch + 1]).generate_state(1, np.uint32)[0]
    return (rows.astype(np.int64) * 0x9E3779B1 + int(mix)) & 0xFFFFFFFF


@dataclass
class DataPlan:
    """Which rows each step of this rank reads: a pure function of the store size, the config and the rank."""

    train_rows: np.ndarray
    val_rows: np.ndarray
    rows_per_step: int
    seed: int
    rank: int
    world: int

    @property
    def steps_per_epoch(self) -> int:
        return (len(self.train_rows) // self.world) // self.rows_per_step

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, index of the first row of `step` in this rank's epoch order)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        return epoch, i * self.rows_per_step

    def steps(self, start: int, stop: int):
        """(rows, anchor keys) of steps start..stop-1, crossing epochs."""
        order, order_epoch = None, None
        for step in range(start, stop):
            epoch, i = self.position(step)
            if epoch != order_epoch:
                order, order_epoch = reader.epoch_order(self.train_rows, self.seed, epoch, self.rank, self.world), epoch
            rows = order[i : i + self.rows_per_step]
            yield rows, _row_keys(self.seed, epoch, rows)

    def val_batches(self, rows_per_batch: int):
        """This rank's held-out rows in batches (with row keys, which validation's anchors do not use)."""
        mine = self.val_rows[self.rank :: self.world]
        for i in range(0, len(mine), rows_per_batch):
            rows = mine[i : i + rows_per_batch]
            yield rows, _row_keys(self.seed, -1, rows)  # -1: a key of its own, never a training epoch


# ---------------------------------------------------------------------------------------------- setup


def _target_path(cfg: TrainConfig, manifest: dict) -> str:
    path = cfg.target or manifest["fingerprint"]["model"]
    if cfg.target is None and Path(path).is_absolute() and not Path(path).exists():  # (a hub name is not absolute)
        raise DflashError(
            f"the store was harvested from {path}, which is not here; pass --target the target checkpoint folder"
        )
    return path


def drafter_config(cfg: TrainConfig, manifest: dict, target_path: str) -> DrafterConfig:
    """The drafter shaped like the target recorded in the store; --draft-layers and overrides on top."""
    overrides = {"block_size": cfg.block_size, **cfg.drafter_overrides}
    mask = overrides.pop("mask_token_id", manifest["tokenizer"]["special_ids"].get("mask"))
    if mask is None:
        raise DflashError(
            f"the target's tokenizer has no {MASK_TOKEN} token and no mask token id was given; "
            "pass --drafter-option mask_token_id=ID (a token id of the target's vocabulary)"
        )
    return DrafterConfig.from_target_config(
        load_config(target_path, "--target"), manifest["layer_ids"], mask, num_layers=cfg.draft_layers, **overrides
    )


def load_frozen(path: str, manifest: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head, checked against the vocabulary and width the store was made with."""
    embed, head = load_embedding_and_head(path)
    want = (manifest["target"]["vocab_size"], manifest["target"]["hidden_size"])
    for name, w in (("embedding", embed), ("LM head", head)):
        if tuple(w.shape) != want:
            raise DflashError(
                f"the {name} of {path} is {tuple(w.shape)} but the store was harvested from a target with "
                f"vocabulary {want[0]} and hidden size {want[1]}; pass --target the checkpoint the store was made from"
            )
    return embed, head


def check_shapes(cfg: TrainConfig, token_budget: int, anchors: int, feature_dim: int, dcfg: DrafterConfig):
    B = cfg.block_size
    if B < 2 or token_budget < B:
        raise DflashError(
            f"a row of the store holds {token_budget} tokens, which cannot hold a block of {B}; "
            "use --block-size of at least 2 and at most the store's token budget"
        )
    if not 1 <= anchors <= token_budget - B + 1:
        raise DflashError(
            f"{anchors} anchors per row cannot fit a {token_budget}-token row with blocks of {B} "
            f"(at most {token_budget - B + 1}); lower --anchors"
        )
    if feature_dim != dcfg.feature_dim:
        raise DflashError(
            f"the store's features are {feature_dim} wide but the drafter expects {len(dcfg.target_layer_ids)} "
            f"layers x {dcfg.hidden_size} = {dcfg.feature_dim}; the store's manifest and target do not match"
        )


# ---------------------------------------------------------------------------------------------- metrics slots


class Slots:
    """Names of the entries of the float64 metric accumulators (one vector: one device-to-host read per log)."""

    def __init__(self, block_size: int):
        scalars = ["loss_sum", "weight_sum", "accepted", "blocks", "context_tokens", "pairs", "grad_norm", "steps",
                   "replay_rounds", "replay_tokens"]  # fmt: skip
        self.index = {name: i for i, name in enumerate(scalars)}
        self.correct = slice(len(scalars), len(scalars) + block_size - 1)
        self.counted = slice(self.correct.stop, self.correct.stop + block_size - 1)
        self.size = self.counted.stop

    def __getitem__(self, name):
        return self.index[name]


# ---------------------------------------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, cfg: TrainConfig, env: Env):
        from dflash.store import ShardStore

        self.cfg, self.env, self.device = cfg, env, env.device
        self.cuda = self.device.type == "cuda"
        self.store = ShardStore.open(cfg.shards)
        manifest = self.store.manifest
        self.target_path = _target_path(cfg, manifest)
        embed, head = load_frozen(self.target_path, manifest)
        self.dcfg = drafter_config(cfg, manifest, self.target_path)
        T = self.store.token_budget
        self.num_anchors = cfg.anchors or max(1, round(T * ANCHORS_PER_3072 / 3072))
        check_shapes(cfg, T, self.num_anchors, self.store.feature_dim, self.dcfg)
        self.gamma = blocks.default_gamma(cfg.block_size) if cfg.gamma is None else cfg.gamma

        self.mm_dtype = torch.bfloat16 if self.cuda else torch.float32
        # Frozen and only ever read by matmuls under autocast: stored in the matmul dtype, no per-step cast.
        self.embed, self.head = embed.to(self.device, self.mm_dtype), head.to(self.device, self.mm_dtype)
        torch.manual_seed(cfg.seed)
        with torch.device(self.device):
            self.model = DFlashDrafter(self.dcfg)
        self.params = [p for p in self.model.parameters()]
        self.flat_grad = self._flat_grad()
        self.step_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self.lr_t = torch.full((), cfg.lr, dtype=torch.float32, device=self.device)
        self.optimizer = self._optimizer()

        self.shape = reader.BatchShape(cfg.grad_accum, cfg.rows_per_step, T, self.store.feature_dim)
        self.static = graph.StaticBuffers(reader.allocate_batch(self.shape, self.device))
        self.feed = reader.DeviceFeed(self.static)
        self.slots = Slots(cfg.block_size)
        self.acc = torch.zeros(self.slots.size, dtype=torch.float64, device=self.device)
        self.val_acc = torch.zeros_like(self.acc)
        # Validation anchors every eligible position, one window of A positions per replay of its step, and
        # keeps the drafts accepted at each one for the replay of decoding (-1: no counted anchor; column T
        # takes the invalid anchors' writes).
        self.val_windows = -(-T // self.num_anchors)
        self.val_window = torch.zeros((), dtype=torch.int64, device=self.device)
        self.val_runs = torch.full((cfg.rows_per_step, T + 1), -1, dtype=torch.int32, device=self.device)

        self.val_store = self.store
        if cfg.val_shards:
            self.val_store = ShardStore.open(cfg.val_shards)
            check_val_store(manifest, self.val_store.manifest, cfg.shards, cfg.val_shards)
            train_rows, val_rows = np.arange(self.store.num_rows), np.arange(self.val_store.num_rows)
        else:
            train_rows, val_rows = reader.split_rows(self.store.num_rows, cfg.val_fraction)
        self.plan = DataPlan(train_rows, val_rows, self.shape.rows_per_step, cfg.seed, env.rank, env.world)
        if self.plan.steps_per_epoch == 0:
            raise DflashError(
                f"the store's {len(train_rows)} training rows give no full step of {self.shape.rows_per_step} rows "
                f"on each of {env.world} ranks; lower --rows-per-step / --grad-accum or harvest more data"
            )
        self.total_steps = cfg.max_steps or cfg.epochs * self.plan.steps_per_epoch

        compile_on = self.cuda if cfg.compile is None else cfg.compile
        self.forward = graph.compile_fn(self.model, compile_on)
        # On the CPU the drafter evaluates the mask densely (flex_attention has no CPU backward), so a compiled
        # BlockMask buys nothing there, and inductor's C++ code for create_block_mask fails on some shapes.
        self.mask_fn = graph.compile_fn(
            blocks.block_attention_mask, compile_on and self.cuda, options=blocks.MASK_COMPILE_OPTIONS
        )
        self.loss_fn = graph.compile_fn(loss.block_cross_entropy, compile_on)
        hint = "--anchors, --rows-per-step (or the store's token budget) or --loss-chunk"
        self.train_step = graph.GraphedStep(self._train_step, device=self.device, cuda_graph=cfg.cuda_graph, hint=hint)
        self.val_step = graph.GraphedStep(self._val_step, device=self.device, cuda_graph=cfg.cuda_graph, hint=hint)

    # ---- construction helpers

    def _flat_grad(self) -> torch.Tensor:
        """One fp32 buffer that every parameter's .grad views: one all-reduce, one norm, no per-step allocation.

        Autograd accumulates into an existing .grad in place, so the views survive backward and accumulation.
        """
        flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=self.device)
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _optimizer(self) -> torch.optim.AdamW:
        cfg = self.cfg
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # norms' gains: decaying them pulls toward zero, not one
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # lr is a device tensor that the step rewrites in place; fused (CUDA and CPU) accepts a tensor lr, and
        # capturable keeps the step count on the device so the update can live in a CUDA graph.
        return torch.optim.AdamW(
            groups, lr=self.lr_t, betas=cfg.betas, eps=cfg.eps, fused=True, capturable=self.cuda
        )

    def _autocast(self):
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- the step (captured)

    def _inputs(self, m: int, window: torch.Tensor | None = None) -> dict:
        """Micro-batch m's blocks: random anchors, or every position of `window` (validation)."""
        s, cfg = self.static, self.cfg
        # Pieces of a split document share a doc id and may sit side by side: blocks must see one piece only.
        segments = blocks.segment_ids(s["doc_ids"][m], s["position_ids"][m])
        if window is None:
            anchors, valid = blocks.sample_anchors(
                s["loss_mask"][m], segments, self.num_anchors, cfg.block_size, s["anchor_keys"][m][:, None]
            )
        else:
            anchors, valid = blocks.window_anchors(s["loss_mask"][m], segments, window, self.num_anchors, cfg.block_size)
        block_ids, q_positions, labels, weights = blocks.block_inputs(
            s["input_ids"][m], s["position_ids"][m], s["loss_mask"][m], anchors, valid,
            self.dcfg.mask_token_id, cfg.block_size, self.gamma,
        )  # fmt: skip
        return dict(
            anchors=anchors, valid=valid, segments=segments, block_ids=block_ids, q_positions=q_positions,
            labels=labels, weights=weights,
        )  # fmt: skip

    def _micro(self, m: int, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted-mean loss of micro-batch m, correct [N]) through drafter and frozen head."""
        s = self.static
        mask = self.mask_fn(x["anchors"], x["valid"], x["segments"], self.cfg.block_size)
        features = s["hidden"][m].to(self.mm_dtype)
        with self._autocast():
            embeds = F.embedding(x["block_ids"], self.embed)
            hidden = self.forward(embeds, features, x["q_positions"], s["position_ids"][m], mask)
            labels, weights = x["labels"].flatten(), x["weights"].flatten()
            return self.loss_fn(hidden.flatten(0, 1), self.head, labels, weights, self.cfg.loss_chunk)

    def _count(self, acc: torch.Tensor, m: int, x: dict, mean_loss: torch.Tensor, correct: torch.Tensor):
        """Add this micro-batch's sums to the accumulators (device ops only)."""
        B, slots = self.cfg.block_size, self.slots
        stats = loss.block_stats(correct, x["weights"], B)
        weight = x["weights"].sum()
        values = torch.zeros_like(acc)
        values[slots["loss_sum"]] = mean_loss.detach() * weight
        values[slots["weight_sum"]] = weight
        values[slots["accepted"]] = stats.accepted
        values[slots["blocks"]] = stats.anchors
        values[slots["context_tokens"]] = (x["segments"] >= 0).sum()
        values[slots["pairs"]] = visible_pairs(x["anchors"], x["valid"], x["segments"], B)
        values[slots.correct] = stats.correct
        values[slots.counted] = stats.counted
        acc += values

    def _train_step(self):
        cfg, G = self.cfg, self.cfg.grad_accum
        inputs = [self._inputs(m) for m in range(G)]
        # Normalise by the weight of the whole global batch (all micro-steps, all ranks), so that accumulation
        # and any number of ranks give the gradient of one big batch. Weights do not depend on the model, so the
        # total is known before the first forward.
        total = torch.stack([x["weights"].sum() for x in inputs]).sum()
        if self.env.world > 1:
            dist.all_reduce(total)
        self.flat_grad.zero_()
        for m, x in enumerate(inputs):
            mean_loss, correct = self._micro(m, x)
            (mean_loss * (x["weights"].sum() / total.clamp(min=1e-6))).backward()
            self._count(self.acc, m, x, mean_loss, correct)
        if self.env.world > 1:
            dist.all_reduce(self.flat_grad)
        # Clipping on the flat buffer is one norm kernel and one scale, whatever the number of parameters.
        norm = torch.linalg.vector_norm(self.flat_grad)
        self.flat_grad.mul_((cfg.clip / (norm + 1e-6)).clamp(max=1.0))
        self.lr_t.copy_(learning_rate(self.step_t, cfg, self.total_steps))
        self.optimizer.step()
        self.step_t += 1
        self.acc[self.slots["grad_norm"]] += norm
        self.acc[self.slots["steps"]] += 1

    def _val_step(self):
        with torch.no_grad():
            x = self._inputs(0, self.val_window)
            mean_loss, correct = self._micro(0, x)
            self._count(self.val_acc, 0, x, mean_loss, correct)
            run, counted = loss.leading_runs(*loss.block_hits(correct, x["weights"], self.cfg.block_size))
            anchors = x["anchors"]
            column = torch.where(counted.view_as(anchors), anchors, self.val_runs.shape[1] - 1)
            self.val_runs.scatter_(1, column, run.view_as(anchors).int())

    # ---- warmup, capture and state

    def prepare(self, checkpoint: Path | None) -> dict[str, float]:
        """Compile and capture on synthetic rows, then put back the initial (or the checkpoint's) state.
        Returns the seconds each part took: compiles can dominate a short run, and their cost is easy to miss."""
        initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self._synthetic_rows()
        times, t0 = {}, time.perf_counter()
        self.train_step.warmup()
        times["train_warmup_s"] = time.perf_counter() - t0
        self.val_step.warmup(1)
        times["val_warmup_s"] = time.perf_counter() - t0 - times["train_warmup_s"]
        compiled = graph.compiled_graphs()
        self.train_step.capture()
        self.val_step.pool = self.train_step.graph.pool() if self.train_step.graph is not None else None
        self.val_step.capture()
        self.compiled_graphs = compiled
        with torch.no_grad():
            self.model.load_state_dict(initial)
            for state in self.optimizer.state.values():
                for value in state.values():
                    value.zero_()
            self.step_t.zero_()
        if checkpoint is not None:
            load_checkpoint(self, checkpoint)
        elif self.env.world > 1:
            for p in self.params:  # identical seeds already give identical weights; make it a guarantee
                dist.broadcast(p.data, 0)
        self.acc.zero_()
        self.val_acc.zero_()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        times["total_s"] = time.perf_counter() - t0
        times["capture_s"] = times["total_s"] - times["train_warmup_s"] - times["val_warmup_s"]
        return times

    def _synthetic_rows(self):
        """Plausible rows for warmup (one document per row, every token trained): never all zeros."""
        g = torch.Generator().manual_seed(1234)
        s, (G, R, T, Fd) = self.static, self.shape.field_shape("hidden")
        s.load("hidden", torch.randn(G, R, T, Fd, generator=g).to(torch.bfloat16).to(self.device))
        ids = torch.randint(0, self.dcfg.vocab_size, (G, R, T), generator=g, dtype=torch.int32)
        s.load("input_ids", ids.to(self.device))
        s.load("position_ids", torch.arange(T, dtype=torch.int32).expand(G, R, T).contiguous().to(self.device))
        s.load("doc_ids", torch.zeros(G, R, T, dtype=torch.int32, device=self.device))
        s.load("loss_mask", torch.ones(G, R, T, dtype=torch.uint8, device=self.device))
        s.load("anchor_keys", torch.arange(G * R, dtype=torch.int64).view(G, R).to(self.device))

    # ---- the loop

    def fit(self, start_step: int, log: "MetricsLog") -> dict:
        cfg = self.cfg
        meter = Meter(self)
        if start_step >= self.total_steps:
            return meter.summary()
        rows = self._reader(self.store, self.plan.steps(start_step, self.total_steps), self.shape)
        try:
            with graph.no_recompiles():
                self.feed.stage(meter.wait(rows.next))
                for step in range(start_step, self.total_steps):
                    self.feed.commit()
                    self.train_step()
                    done = step + 1
                    if cfg.val_every and done % cfg.val_every == 0 and done < self.total_steps:
                        # Before staging: validation uses the same staging buffers.
                        log.write(meter.set_aside(lambda: self.validate(done)))
                    if done < self.total_steps:
                        # Queued right behind the step: the copy overlaps its compute.
                        self.feed.stage(meter.wait(rows.next))
                    if done % cfg.log_every == 0 or done == self.total_steps:
                        log.write(meter.read(done))
                    if done % cfg.ckpt_every == 0 or done == self.total_steps:
                        save_checkpoint(self, done)
        finally:
            self.feed.drain()
            rows.close()
        return meter.summary()

    def validate(self, step: int) -> dict | None:
        """Forward-only pass over this rank's held-out rows, every eligible anchor scored; sums over all ranks.

        Costs ceil(T / A) forward passes per held-out batch, and one host read of the accepted drafts per batch
        for the replay of decoding. None when the held-out rows hold no block (no held-out rows, or
        --val-fraction 0)."""
        shape = dataclasses.replace(self.shape, micro_batches=1)
        rows = self._reader(self.val_store, self.plan.val_batches(self.cfg.rows_per_step), shape)
        self.val_acc.zero_()
        rounds = tokens = 0
        try:
            with graph.no_recompiles():
                while (batch := rows.next()) is not None:
                    self.feed.stage(batch)
                    self.feed.commit()
                    self.val_runs.fill_(-1)
                    for window in range(self.val_windows):
                        self.val_window.fill_(window)
                        self.val_step()
                    batch_rounds, batch_tokens = loss.replay_decoding(self.val_runs[:, :-1].cpu().numpy())
                    rounds, tokens = rounds + batch_rounds, tokens + batch_tokens
        finally:
            self.feed.drain()
            rows.close()
        self.val_acc[self.slots["replay_rounds"]] += rounds
        self.val_acc[self.slots["replay_tokens"]] += tokens
        if self.env.world > 1:
            dist.all_reduce(self.val_acc)
        totals = self.val_acc.tolist()
        return self._summarise(totals, "val", step) if totals[self.slots["blocks"]] else None

    def _reader(self, store, steps, shape: reader.BatchShape) -> reader.RowReader:
        cfg = self.cfg
        return reader.RowReader(store, steps, shape, depth=cfg.prefetch, workers=cfg.reader_workers, pin=self.cuda)

    def _summarise(self, acc: list[float], kind: str, step: int) -> dict:
        sl = self.slots
        correct, counted = acc[sl.correct], acc[sl.counted]
        record = {
            "kind": kind,
            "step": step,
            "loss": acc[sl["loss_sum"]] / max(acc[sl["weight_sum"]], 1e-12),
            "accept_len": acc[sl["accepted"]] / max(acc[sl["blocks"]], 1),
            "acc": [c / max(n, 1) for c, n in zip(correct, counted)],
            "blocks": int(acc[sl["blocks"]]),
        }
        if acc[sl["replay_rounds"]]:
            record.update(tau=acc[sl["replay_tokens"]] / acc[sl["replay_rounds"]], rounds=int(acc[sl["replay_rounds"]]))
        return record


def visible_pairs(anchors, valid, doc_ids, block_size) -> torch.Tensor:
    """(query, key) pairs the BlockMask lets attend, over valid blocks: each of a block's B queries sees the
    context of its document before the anchor and the B tokens of its block (documents are contiguous runs)."""
    T = doc_ids.shape[1]
    position = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, position, 0).cummax(dim=1).values
    context = anchors - doc_start.gather(1, anchors)
    return (block_size * (context + block_size) * valid).sum()


# ---------------------------------------------------------------------------------------------- metrics


def step_flops(dcfg: DrafterConfig, context_tokens: float, drafted: float, labelled: float, pairs: float) -> float:
    """Model FLOPs of the counted work (docs/training.md): trainable matmuls 3x forward, the frozen LM head 2x
    (forward and input gradient; its weight gradient is never computed), attention 3.5 x 4 x pairs x heads x hd."""
    H, F_, hd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.head_dim
    q_width, kv_width = dcfg.num_attention_heads * hd, dcfg.num_key_value_heads * hd
    per_layer_block = 2 * (H * q_width + q_width * H + 3 * H * F_ + 2 * H * kv_width)  # per block token
    per_layer_context = 2 * (2 * H * kv_width)  # k / v projections of the context
    trainable = dcfg.num_layers * (per_layer_block * drafted + per_layer_context * context_tokens)
    trainable += 2 * dcfg.feature_dim * H * context_tokens  # fc
    head = 2 * dcfg.vocab_size * H * labelled
    attention = dcfg.num_layers * 4 * pairs * dcfg.num_attention_heads * hd
    return 3 * trainable + 2 * head + 3.5 * attention


class Meter:
    """Turns the device accumulators into one metrics record per log step; times the loop and the data waits."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.last = time.perf_counter()
        self.waited = 0.0
        self.memory: list[tuple[int, int]] = []
        self.records: list[dict] = []

    def wait(self, get):
        t0 = time.perf_counter()
        item = get()
        self.waited += time.perf_counter() - t0
        return item

    def set_aside(self, fn):
        """Run fn outside the timed training: validation's seconds count in no step's time. The steps queued
        before it finish first, so that their time stays theirs."""
        if self.t.cuda:
            torch.cuda.synchronize(self.t.device)
        t0 = time.perf_counter()
        result = fn()
        self.last += time.perf_counter() - t0
        return result

    def read(self, step: int) -> dict:
        t, world = self.t, self.t.env.world
        if world > 1:  # sums over all ranks: the record describes the global batch
            dist.all_reduce(t.acc)
        acc = t.acc.tolist()  # the one host sync of a log step
        t.acc.zero_()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        sl, B = t.slots, t.cfg.block_size
        steps = max(acc[sl["steps"]], 1)  # summed over ranks, like grad_norm
        record = t._summarise(acc, "train", step)
        labelled = sum(acc[sl.counted])
        drafted = acc[sl["blocks"]] * B
        flops = step_flops(t.dcfg, acc[sl["context_tokens"]], drafted, labelled, acc[sl["pairs"]])
        record.update(
            epoch=t.plan.position(step - 1)[0],
            lr=float(t.lr_t),
            grad_norm=acc[sl["grad_norm"]] / steps,
            step_ms=1000 * elapsed / (steps / world),
            context_tok_s=acc[sl["context_tokens"]] / elapsed,
            drafted_tok_s=labelled / elapsed,
            mfu=flops / elapsed / (world * t.cfg.peak_tflops * 1e12) if t.cuda else None,
            data_wait=self.waited / elapsed,
            recompiles=graph.compiled_graphs() - t.compiled_graphs,
        )
        self.waited = 0.0
        if t.cuda:
            mem = (torch.cuda.memory_allocated(t.device), torch.cuda.memory_reserved(t.device))
            self.memory.append(mem)
            record.update(mem_allocated=mem[0], mem_reserved=mem[1], mem_peak=torch.cuda.max_memory_allocated(t.device))
        self.records.append(record)
        return record

    def summary(self) -> dict:
        out = {"records": self.records}
        if self.memory:
            allocated, reserved = zip(*self.memory)
            out.update(allocated_spread=max(allocated) - min(allocated), reserved_spread=max(reserved) - min(reserved))
        return out


class MetricsLog:
    """One console line per record (rank 0), `metrics.jsonl`, and TensorBoard scalars under `tb/`."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.jsonl = (out / "metrics.jsonl").open("a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"))

    def write(self, record: dict | None):
        if not self.enabled or record is None:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        logger.info(format_record(record))
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            for k, value in enumerate(record["acc"], start=1):
                self.tb.add_scalar(f"{record['kind']}/acc_k{k:02d}", value, record["step"])

    def close(self):
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def format_record(r: dict) -> str:
    acc = r["acc"]
    head = (
        f"{r['kind']} step {r['step']}: loss {r['loss']:.4f} accept {r['accept_len']:.2f} "
        f"acc k1 {acc[0]:.3f} k{len(acc)} {acc[-1]:.3f}"
    )
    if r["kind"] != "train":
        tau = f" tau {r['tau']:.2f} ({r['rounds']} rounds)" if "tau" in r else ""
        return head + f"{tau} ({r['blocks']} blocks)"
    mfu = f" mfu {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    mem = f" mem {r['mem_allocated'] / 2**30:.1f}/{r['mem_reserved'] / 2**30:.1f} GiB" if "mem_allocated" in r else ""
    return (
        f"{head} | lr {r['lr']:.2e} gnorm {r['grad_norm']:.2f} | {r['step_ms']:.0f} ms/step "
        f"ctx {r['context_tok_s']:.0f} tok/s drafted {r['drafted_tok_s']:.0f} tok/s{mfu} "
        f"wait {100 * r['data_wait']:.1f}%{mem} recompiles {r['recompiles']}"
    )


# ---------------------------------------------------------------------------------------------- checkpoints

CKPT_PREFIX = "step_"


def checkpoint_dir(out) -> Path:
    return Path(out) / "checkpoints"


def latest_checkpoint(out) -> Path | None:
    """The complete checkpoint with the highest step: complete ones are exactly those renamed to step_N."""
    folder = checkpoint_dir(out)
    numbers = [p.name.removeprefix(CKPT_PREFIX) for p in folder.glob(f"{CKPT_PREFIX}*")]
    steps = [int(n) for n in numbers if n.isdigit()]
    return folder / f"{CKPT_PREFIX}{max(steps)}" if steps else None


def check_replicas(t: Trainer):
    """Every rank must hold the same weights (same gradients, same update): compare per-tensor checksums."""
    if t.env.world == 1:
        return
    sums = torch.stack([p.detach().sum(dtype=torch.float64) for p in t.params])
    gathered = [torch.empty_like(sums) for _ in range(t.env.world)]
    dist.all_gather(gathered, sums)
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        raise DflashError("the ranks' weights diverged; this is a bug in dflash, please report it")


def save_checkpoint(t: Trainer, step: int):
    """Written into a temporary folder that rank 0 renames to step_N once every rank's files are in it."""
    check_replicas(t)
    final = checkpoint_dir(t.cfg.out) / f"{CKPT_PREFIX}{step}"
    tmp = final.with_name(f".tmp-{final.name}")
    if t.env.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(t.env)
    rng = {"torch": torch.get_rng_state()}
    if t.cuda:
        rng["cuda"] = torch.cuda.get_rng_state(t.device)
    torch.save(rng, tmp / f"rng_rank{t.env.rank}.pt")
    if t.env.main:
        epoch, index = t.plan.position(step)
        state = {
            "step": step,
            "epoch": epoch,
            "index": index,
            "total_steps": t.total_steps,
            "fingerprint": fingerprint(t.cfg, t.env.world),
            "config": dataclasses.asdict(t.cfg),
            "drafter": dataclasses.asdict(t.dcfg),
            "world": t.env.world,
        }
        torch.save(t.model.state_dict(), tmp / "model.pt")
        torch.save(t.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    _barrier(t.env)
    if t.env.main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier(t.env)


def read_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def check_resumable(cfg: TrainConfig, world: int, path: Path):
    """A resume must continue the same run: every option that shapes the trajectory must be unchanged."""
    details = describe_differences(read_state(path)["fingerprint"], fingerprint(cfg, world), "checkpoint", "now")
    if details:
        raise DflashError(
            f"cannot resume {path}: the run was made with other options ({details}); "
            "rerun with the original options or train into a new --out"
        )


def load_checkpoint(t: Trainer, path: Path):
    """Copy the checkpoint into the live tensors in place: the captured graph keeps reading the same storage."""
    state = read_state(path)
    with torch.no_grad():
        t.model.load_state_dict(torch.load(path / "model.pt", map_location=t.device))
        saved = torch.load(path / "optimizer.pt", map_location=t.device)["state"]
        # optimizer.state_dict() numbers the parameters in param-group order
        ordered = [p for group in t.optimizer.param_groups for p in group["params"]]
        for i, p in enumerate(ordered):
            for key, value in t.optimizer.state[p].items():
                value.copy_(saved[i][key])
        t.step_t.fill_(state["step"])
    rng = torch.load(path / f"rng_rank{t.env.rank}.pt")
    torch.set_rng_state(rng["torch"])
    if t.cuda and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], t.device)


def _barrier(env: Env):
    if env.world > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- entry points


def run_training(cfg: TrainConfig) -> dict:
    """Train (or resume) a drafter; returns the final metrics, validation and export path (rank 0 writes files)."""
    check_config(cfg)
    env = init_distributed(cfg.device)
    out = Path(cfg.out)
    try:
        checkpoint = None
        if cfg.resume:
            checkpoint = latest_checkpoint(out)
            if checkpoint is None:
                raise DflashError(f"--resume: {out} has no complete checkpoint; start without --resume")
            check_resumable(cfg, env.world, checkpoint)
            if env.main:
                _drop_records_after(out / "metrics.jsonl", read_state(checkpoint)["step"])
        elif latest_checkpoint(out) is not None:
            raise DflashError(
                f"{out} already holds checkpoints of a run; pass --resume to continue it or choose a new --out"
            )
        trainer = Trainer(cfg, env)
        if env.main:
            out.mkdir(parents=True, exist_ok=True)
        start = read_state(checkpoint)["step"] if checkpoint is not None else 0
        prep = trainer.prepare(checkpoint)
        log = MetricsLog(out, env.main, cfg.tensorboard)
        logger.info(
            "training %d-layer drafter (%.1f M parameters) on %d rank(s) from step %d to %d; warmup + capture "
            "%.1f s (train step %.1f s, validation step %.1f s, capture and state restore %.1f s)",
            trainer.dcfg.num_layers, sum(p.numel() for p in trainer.params) / 1e6, env.world, start,
            trainer.total_steps, prep["total_s"], prep["train_warmup_s"], prep["val_warmup_s"], prep["capture_s"],
        )  # fmt: skip
        try:
            result = trainer.fit(start, log)
            val = trainer.validate(trainer.total_steps)
            log.write(val)
        finally:
            log.close()
        result["val"] = val
        result["prepare_s"] = prep
        if "allocated_spread" in result:
            logger.info(
                "memory over the run: allocated spread %d B, reserved spread %d B, peak %.1f GiB",
                result["allocated_spread"], result["reserved_spread"],
                torch.cuda.max_memory_allocated(env.device) / 2**30,
            )  # fmt: skip
        if cfg.export and env.main:
            result["export"] = str(
                export_drafter(trainer.model, trainer.dcfg, out / "drafter", dtype=getattr(torch, cfg.export_dtype))
            )
        return result
    finally:
        if env.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _drop_records_after(path: Path, step: int):
    """A resumed run recomputes the steps after its checkpoint: drop the interrupted run's records of them."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))


def export_run(run, out, step: int | None = None, dtype: str = "bfloat16") -> Path:
    """Write the drafter of a run's checkpoint (the latest complete one by default) in the public layout."""
    run = Path(run)
    path = latest_checkpoint(run) if step is None else checkpoint_dir(run) / f"{CKPT_PREFIX}{step}"
    if path is None or not (path / "state.json").exists():
        which = "a complete checkpoint" if step is None else f"checkpoint step {step}"
        raise DflashError(f"{run} has no {which} (looked in {checkpoint_dir(run)}); train first or pick another --step")
    dcfg = DrafterConfig(**read_state(path)["drafter"])
    with torch.device("meta"):
        model = DFlashDrafter(dcfg)
    model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"), assign=True)
    return export_drafter(model, dcfg, out, dtype=getattr(torch, dtype))
