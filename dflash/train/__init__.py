"""The DFlash trainer: one process per device, one compiled and CUDA-graphed step, rows streamed from the store.

    run_training(cfg)    (dflash.train.run: the run's folder, lock, resume point, export)
      Trainer.__init__   store, drafter, frozen embedding / LM head, static buffers, optimizer, data plan
      Trainer.prepare    warmup + capture on synthetic rows, restore the initial (or checkpointed) state
      Trainer.fit        feed -> replay -> metrics / checkpoints, then validation and export

Everything a step does happens on the device inside `_train_step` (captured once, replayed every step). The
host only copies the next rows into the static buffers and, on log steps, reads the metric sums: the hot loop
has no host synchronisation and allocates nothing. Around the trainer: `dflash.config.TrainConfig` (the
options), `dflash.train.setup` (the checks and decisions before any work: store, drafter config, memory, run
folder, ranks), `dflash.drafter.attention` (the flex_attention options and BlockMask tiles of a CUDA step),
`dflash.train.reader` (the data plan and the row streaming), `dflash.train.metrics` (the sums and records; the FLOP
count is `dflash.drafter.flops`'), `dflash.train.checkpoint` (save, load, resume checks, export). Formulas (MFU,
metrics) and resume semantics are documented in docs/training.md.
"""

import contextlib
import dataclasses
import functools
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dflash import features, methods
from dflash.config import TrainConfig
from dflash.drafter import blocks, flash_kv_repeat, graph, loss, memory
from dflash.drafter.attention import (
    attention_kernel_errors,
    attention_kernel_options,
    describe_choice,
    mask_function,
    mask_tile,
)
from dflash.drafter.flops import visible_pairs
from dflash.errors import DflashError
from dflash.store import Store
from dflash.train import reader
from dflash.train.checkpoint import (
    Checkpointer,
    any_rank,
    max_over_ranks,
)
from dflash.train.metrics import Meter, MetricsLog, Tally, source_sums
from dflash.train.setup import (
    Env,
    StopSignals,
    anchors_per_row,
    check_anchorable,
    check_host_memory,
    check_self_check,
    check_shapes,
    check_step_memory,
    check_target_weights,
    check_teacher,
    check_val_store,
    describe_embedding,
    describe_objective,
    drafter_config,
    load_frozen,
    stop_error,
    tally_for,
    target_path_for,
)

logger = logging.getLogger("dflash")


# ---------------------------------------------------------------------------------------------- schedule


def learning_rate(step: torch.Tensor, cfg: TrainConfig, total_steps: int) -> torch.Tensor:
    """Linear warmup then cosine to min_lr_ratio * lr, as device tensor ops on the step counter (graph-safe)."""
    warmup = max(1, round(cfg.warmup_ratio * total_steps))
    s = step.float()
    warm = (s + 1) / warmup
    progress = ((s - warmup) / max(1, total_steps - warmup)).clamp(0, 1)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
    return cfg.lr * torch.where(s < warmup, warm, cosine)


# ---------------------------------------------------------------------------------------------- the trainer


class Trainer:
    """One rank's training: the frozen target tensors, the drafter and its optimizer, the static step buffers and
    the two captured steps (train, validation); `prepare`, then `fit` and `validate`."""

    def __init__(self, cfg: TrainConfig, env: Env):
        self.cfg, self.env, self.device = cfg, env, env.device
        self.cuda = self.device.type == "cuda"
        self.store = Store.open(cfg.store)
        check_self_check(cfg, self.store)
        manifest = self.store.manifest
        self.target_path = target_path_for(cfg, self.store)
        target = check_target_weights(cfg, self.store, self.target_path)
        self.dcfg = drafter_config(cfg, self.store, self.target_path, target)
        self.encoding = manifest.features
        # P [k, n*H] of a subspace store, kept with every checkpoint. The step lifts the stored P h back to P^T P h,
        # so that fc is trained at full width in the target's own basis, as on a full store (same parameters, same
        # initialisation, same optimiser geometry: Adam is not invariant to rotating fc's input); the export folds
        # P^T P into fc.
        self.projection = None if self.store.projection is None else torch.from_numpy(self.store.projection)
        T = self.store.token_budget
        self.num_anchors = anchors_per_row(cfg, T)
        check_shapes(T, self.num_anchors, manifest.feature_dim, self.dcfg)
        check_anchorable(self.store, self.dcfg.span, cfg.store)
        # The block geometry: B query slots per block, labels over the S tokens from its anchor to its last draft.
        self.block_size, self.span = self.dcfg.block_size, self.dcfg.span
        self.gamma = blocks.default_gamma(self.span) if cfg.gamma is None else cfg.gamma
        self.method = methods.get(cfg.method)
        teacher_fields = check_teacher(self.method, self.store, cfg.store, cfg.teacher_loss)
        self.teacher_names = list(teacher_fields)
        fields = reader.row_fields({**self.store.row_layout, **teacher_fields})
        lifted = self.encoding.width if self.projection is not None else 0
        self.teacher_kind = self.store.teacher.kind if teacher_fields else None
        logger.info(describe_objective(self.method, self.store, cfg.teacher_loss, bool(teacher_fields)))
        step_tokens = cfg.grad_accum * cfg.rows_per_step * T
        self.host_embedding = memory.embedding_on_host(cfg.embedding, self.cuda, step_tokens, self.dcfg.vocab_size)
        self.memory_estimate = check_step_memory(
            cfg,
            self.dcfg,
            self.method,
            fields,
            self.num_anchors,
            lifted,
            self.device,
            self.teacher_kind,
            self.host_embedding,
        )
        embed, head = load_frozen(self.target_path, manifest)
        self.objective_options = methods.ObjectiveOptions(
            position_weights=cfg.position_weights,
            loss_chunk=cfg.loss_chunk,
            selector_weight=cfg.selector_weight,
            selector_outside=cfg.selector_outside,
        )

        self.mm_dtype = torch.bfloat16 if self.cuda else torch.float32
        # Frozen and only ever read by matmuls under autocast: stored in the matmul dtype, no per-step cast.
        self.head = head.to(self.device, self.mm_dtype)
        embed = embed.to(self.mm_dtype)
        if self.host_embedding:  # the reader threads look each row's tokens up in the host copy (_embed_row)
            self.host_table = reader.numpy_view(embed.contiguous())
            self.mask_embedding = embed[self.dcfg.mask_token_id].to(self.device)
            fields["token_embeds"] = ((T, self.dcfg.hidden_size), self.mm_dtype)
        else:
            self.embed = embed.to(self.device)
        logger.info(describe_embedding(self.host_embedding, cfg.embedding, embed, step_tokens))
        table_bytes = embed.numel() * embed.element_size() if self.host_embedding else 0
        check_host_memory(cfg, fields, table_bytes, self.device)
        self.lift = None if self.projection is None else self.projection.to(self.device, self.mm_dtype)
        torch.manual_seed(cfg.seed)
        with torch.device(self.device):
            self.model = self.method.model_cls(self.dcfg)
        head_dim = self.dcfg.head_dim
        kernel_options = attention_kernel_options(cfg.attention_kernel_options, self.cuda, head_dim)
        self.model.set_attention_kernel_options(kernel_options)
        self.model.set_recompute(cfg.recompute)
        if cfg.recompute != "none":
            what = "MLP" if cfg.recompute == "mlp" else "element-wise work (norms, RoPE, SwiGLU, weight casts)"
            logger.info("the backward recomputes each drafter layer's %s (--recompute %s)", what, cfg.recompute)
        self.mask_tile = mask_tile(cfg.mask_tile_size, self.cuda, head_dim)
        if self.cuda:
            given = bool(cfg.attention_kernel_options), cfg.mask_tile_size is not None
            repeat = flash_kv_repeat(self.dcfg.num_attention_heads, self.dcfg.num_key_value_heads, kernel_options)
            logger.info(describe_choice(kernel_options, self.mask_tile, head_dim, *given, kv_repeat=repeat))
        self.params = [p for p in self.model.parameters()]
        self.flat_grad = self._flat_grad()
        self.step_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self.lr_t = torch.full((), cfg.lr, dtype=torch.float32, device=self.device)
        self.optimizer = self._optimizer()

        self.shape = reader.BatchShape(cfg.grad_accum, cfg.rows_per_step, fields)
        self.static = graph.StaticBuffers(reader.allocate_batch(self.shape, self.device))
        self.feed = reader.DeviceFeed(self.static)
        self.train_tally = tally_for(self.store, self.span, self.device)  # the sums of the steps since the last log
        # Validation anchors every eligible position, one window of A positions per replay of its step, and
        # keeps the drafts accepted at each one for the replay of decoding (-1: no counted anchor; column T
        # takes the invalid anchors' writes).
        self.val_windows = -(-T // self.num_anchors)
        self.val_window = torch.zeros((), dtype=torch.int64, device=self.device)
        self.val_runs = torch.full((cfg.rows_per_step, T + 1), -1, dtype=torch.int32, device=self.device)

        self.val_store = self.store
        if cfg.val_store:
            self.val_store = Store.open(cfg.val_store)
            check_val_store(cfg, self.store, self.val_store)
            check_anchorable(self.val_store, self.span, cfg.val_store)
            check_teacher(self.method, self.val_store, cfg.val_store, cfg.teacher_loss, bool(self.teacher_names))
            self.val_tally = tally_for(self.val_store, self.span, self.device)  # its own sources
            train_rows, val_rows = np.arange(self.store.num_rows), np.arange(self.val_store.num_rows)
        else:  # held-out rows of the training store: its sources, and their map on the device
            self.val_tally = dataclasses.replace(self.train_tally, sums=self.train_tally.layout.zeros(self.device))
            train_rows, val_rows = reader.split_rows(self.store.num_rows, cfg.val_fraction)
        rows_per_step = self.shape.rows_per_step
        self.plan = reader.DataPlan(train_rows, val_rows, rows_per_step, cfg.seed, env.rank, env.world_size)
        if self.plan.steps_per_epoch == 0:
            held_out = ""
            if not cfg.val_store and len(val_rows):
                held_out = (
                    f" (--val-fraction {cfg.val_fraction} holds out {len(val_rows)} of its {self.store.num_rows} "
                    "rows: lower it, or give held-out documents with --val-shards)"
                )
            raise DflashError(
                f"the store's {len(train_rows)} training rows give no full step of {self.shape.rows_per_step} rows "
                f"on each of {env.world_size} ranks{held_out}; lower --rows-per-step / --grad-accum or harvest more "
                "data"
            )
        self.total_steps = cfg.max_steps or cfg.epochs * self.plan.steps_per_epoch
        self.checkpoints = Checkpointer(cfg.out, env.rank, env.world_size)
        self.damaged = reader.DamagedRows(cfg.max_damaged_rows)  # shared by the training and validation readers
        self.damaged.defer = env.world_size > 1  # several ranks stop together, at a log step (see DamagedRows)

        compile_on = self.cuda if cfg.compile is None else cfg.compile
        if compile_on:
            graph.forget_compiled_code()
        self.forward = graph.compile_fn(self.model, compile_on)
        self.mask_fn = mask_function(self.mask_tile, self.cuda, compile_on)
        self.objective = graph.compile_fn(self.method.objective_fn, compile_on)
        hint = "--anchors, --rows-per-step (or the store's token budget) or --loss-chunk"
        if cfg.cuda_graph and not self.cuda:
            logger.warning("--cuda-graph captures the step on a GPU; on the CPU the step runs uncaptured: ignored")
        graphed = cfg.cuda_graph is not False
        self.train_step = graph.GraphedStep(self._train_step, device=self.device, cuda_graph=graphed, hint=hint)
        self.val_step = graph.GraphedStep(self._val_step, device=self.device, cuda_graph=graphed, hint=hint)

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
        return torch.optim.AdamW(groups, lr=self.lr_t, betas=cfg.betas, eps=cfg.eps, fused=True, capturable=self.cuda)

    def _autocast(self):
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- the step (captured)

    def _inputs(self, m: int, window: torch.Tensor | None = None) -> dict:
        """Micro-batch m's blocks: random anchors, or every position of `window` (validation)."""
        s, S = self.static, self.span
        # Pieces of a split document share a doc id and may sit side by side: blocks must see one piece only.
        segments = blocks.segment_ids(s["doc_ids"][m], s["position_ids"][m])
        if window is None:
            anchors, valid = blocks.sample_anchors(
                s["loss_mask"][m], segments, self.num_anchors, S, s["anchor_keys"][m][:, None]
            )
        else:
            anchors, valid = blocks.window_anchors(s["loss_mask"][m], segments, window, self.num_anchors, S)
        block_ids, q_positions, labels, weights = blocks.block_inputs(
            s["input_ids"][m],
            s["position_ids"][m],
            s["loss_mask"][m],
            anchors,
            valid,
            self.dcfg.mask_token_id,
            self.block_size,
            self.gamma,
            S,
        )
        # The target's distribution of each label: its teacher arrays at the position before the label's.
        teacher = {name: blocks.span_gather(s[name][m], anchors, S, -1).flatten(0, 1) for name in self.teacher_names}
        return dict(
            teacher=teacher,
            anchors=anchors,
            valid=valid,
            segments=segments,
            block_ids=block_ids,
            q_positions=q_positions,
            labels=labels,
            weights=weights,
        )

    def _micro(self, m: int, x: dict) -> methods.Objective:
        """Micro-batch m through the drafter and the method's objective (frozen head)."""
        s, B, S = self.static, self.block_size, self.span
        mask = self.mask_fn(x["anchors"], x["valid"], x["segments"], B, self.dcfg.sliding_window)
        features = self._features(m)
        with self._autocast():
            if self.host_embedding:
                embeds = blocks.block_embeddings(s["token_embeds"][m], x["anchors"], self.mask_embedding, B)
            else:
                embeds = F.embedding(x["block_ids"], self.embed)
            hidden = self.forward(embeds, features, x["q_positions"], s["position_ids"][m], mask)
            hidden = blocks.span_outputs(hidden, B, S).flatten(0, 1)
            labels, weights = x["labels"].flatten(), x["weights"].flatten()
            teacher = x["teacher"] or None
            return self.objective(self.model, hidden, self.head, labels, weights, S, self.objective_options, teacher)

    def _normaliser(self, x: dict) -> torch.Tensor:
        return loss.normaliser(self.cfg.position_weights, x["weights"])

    def _features(self, m: int) -> torch.Tensor:
        """Micro-batch m's features in the matmul dtype, decoded here, on the device, in the step: fp8 values
        scaled, projected ones lifted back to the full width."""
        s = self.static
        if self.encoding.precision == "fp8":
            stored = features.dequantize_fp8(s["hidden"][m], s["scales"][m], self.mm_dtype)
        else:
            stored = s["hidden"][m].to(self.mm_dtype)
        return stored if self.lift is None else stored @ self.lift

    def _count(self, tally: Tally, m: int, x: dict, objective: methods.Objective):
        """Add this micro-batch's metrics to `tally`'s sums (device ops only), per data source when it has several.
        Returns its blocks' stats."""
        S, layout, sums, doc_source = self.span, tally.layout, tally.sums, tally.doc_source
        stats = loss.block_stats(objective.correct, x["weights"], S)
        normaliser = self._normaliser(x)
        values = torch.zeros_like(sums)
        values[layout["loss_sum"]] = objective.loss_sum.detach()
        values[layout["weight_sum"]] = normaliser.sum()
        values[layout["accepted"]] = stats.accepted
        values[layout["blocks"]] = stats.anchors
        values[layout["context_tokens"]] = (x["segments"] >= 0).sum()
        values[layout["pairs"]] = visible_pairs(
            x["anchors"], x["valid"], x["segments"], self.block_size, self.dcfg.sliding_window
        )
        values[layout.correct] = stats.correct
        values[layout.counted] = stats.counted
        if doc_source is not None:
            run, counted = stats.runs, stats.counts
            # A block's document is its anchor's (padding anchors are never counted: any valid index will do).
            docs = self.static["doc_ids"][m].gather(1, x["anchors"]).flatten().clamp(min=0)
            sources = doc_source[docs].clamp(min=0)
            block_loss = objective.position_loss.reshape(-1, S).double().sum(dim=1)
            per_block = [(1 + run) * counted, counted, block_loss, normaliser.reshape(-1, S).double().sum(dim=1)]
            values[layout.per_source] = source_sums(per_block, sources, layout.sources)
        sums += values
        return stats

    def _train_step(self):
        cfg, G = self.cfg, self.cfg.grad_accum
        inputs = [self._inputs(m) for m in range(G)]
        # Normalise by the weight of the whole global batch (all micro-steps, all ranks), so that accumulation
        # and any number of ranks give the gradient of one big batch. Weights do not depend on the model, so the
        # total is known before the first forward.
        total = torch.stack([self._normaliser(x).sum() for x in inputs]).sum()
        if self.env.world_size > 1:
            dist.all_reduce(total)
        self.flat_grad.zero_()
        for m, x in enumerate(inputs):
            objective = self._micro(m, x)
            (objective.loss_sum / total.clamp(min=1e-6)).backward()
            self._count(self.train_tally, m, x, objective)
        if self.env.world_size > 1:
            dist.all_reduce(self.flat_grad)
        # Clipping on the flat buffer is one norm kernel and one scale, whatever the number of parameters.
        norm = torch.linalg.vector_norm(self.flat_grad)
        self.flat_grad.mul_((cfg.clip / (norm + 1e-6)).clamp(max=1.0))
        self.lr_t.copy_(learning_rate(self.step_t, cfg, self.total_steps))
        self.optimizer.step()
        self.step_t += 1
        train = self.train_tally
        train.sums[train.layout["grad_norm"]] += norm
        train.sums[train.layout["steps"]] += 1

    def _val_step(self):
        with torch.no_grad():
            x = self._inputs(0, self.val_window)
            stats = self._count(self.val_tally, 0, x, self._micro(0, x))
            anchors = x["anchors"]
            column = torch.where(stats.counts.view_as(anchors), anchors, self.val_runs.shape[1] - 1)
            self.val_runs.scatter_(1, column, stats.runs.view_as(anchors).int())

    # ---- warmup, capture and state

    def prepare(self, checkpoint: Path | None) -> dict[str, float]:
        """Compile and capture on synthetic rows, then put back the initial (or the checkpoint's) state.
        Returns the seconds each part took: compiles can dominate a short run, and their cost is easy to miss."""
        initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self._synthetic_rows()
        times, t0 = {}, time.perf_counter()
        queries = self.num_anchors * self.block_size
        keys = self.store.token_budget + queries
        with attention_kernel_errors(self.mask_tile, self.dcfg.head_dim, queries, keys):
            self.train_step.warmup()
            times["train_warmup_s"] = time.perf_counter() - t0
            self.val_step.warmup(1)
            times["val_warmup_s"] = time.perf_counter() - t0 - times["train_warmup_s"]
            agree = functools.partial(any_rank, world_size=self.env.world_size, device=self.device)
            graph.settle(self.train_step, self.val_step, on_any_rank=agree)
            times["settle_s"] = time.perf_counter() - t0 - times["train_warmup_s"] - times["val_warmup_s"]
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
        self.train_tally.sums.zero_()
        self.val_tally.sums.zero_()
        if checkpoint is not None:
            self.checkpoints.load(self, checkpoint)  # (with the sums of its steps after the last record)
        elif self.env.world_size > 1:
            for p in self.params:  # identical seeds already give identical weights; make it a guarantee
                dist.broadcast(p.data, 0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        times["total_s"] = time.perf_counter() - t0
        times["capture_s"] = times["total_s"] - times["train_warmup_s"] - times["val_warmup_s"] - times["settle_s"]
        return times

    def _synthetic_rows(self):
        """Plausible rows for warmup (one document per row, every token trained): never all zeros."""
        g = torch.Generator().manual_seed(1234)
        s, (G, R, T, W) = self.static, self.shape.field_shape("hidden")
        values = torch.randn(G, R, T, W, generator=g).to(torch.bfloat16)
        if self.encoding.precision == "fp8":
            bits, exponents = features.quantize_fp8(values, self.encoding.scale_groups)
            s.load("hidden", bits.to(self.device))
            s.load("scales", exponents.to(self.device))
        else:
            s.load("hidden", values.to(self.device))
        ids = torch.randint(0, self.dcfg.vocab_size, (G, R, T), generator=g, dtype=torch.int32)
        s.load("input_ids", ids.to(self.device))
        s.load("position_ids", torch.arange(T, dtype=torch.int32).expand(G, R, T).contiguous().to(self.device))
        s.load("doc_ids", torch.zeros(G, R, T, dtype=torch.int32, device=self.device))
        s.load("loss_mask", torch.ones(G, R, T, dtype=torch.uint8, device=self.device))
        s.load("anchor_keys", torch.arange(G * R, dtype=torch.int64).view(G, R).to(self.device))

    # ---- the loop

    def validation_due(self, step: int) -> bool:
        """Whether a mid-run validation follows `step` (the final one is run_training's)."""
        return bool(self.cfg.val_every) and step % self.cfg.val_every == 0 and 0 < step < self.total_steps

    def fit(self, start_step: int, log: MetricsLog, validate_first: bool = False) -> dict:
        """Train from `start_step` to the last step (`validate_first`: the validation after `start_step` first).
        SIGINT / SIGTERM and a damaged row (unless skipped) stop the run between steps with a checkpoint, as a
        DflashError that says how to go on."""
        cfg = self.cfg
        meter = Meter(self)
        if start_step >= self.total_steps:
            return meter.summary()
        rows = self._reader(self.store, self.plan.steps(start_step, self.total_steps), self.shape)
        saved = start_step  # the step of the last checkpoint (the one resumed from, or none at a fresh start)

        def checkpoint(done: int) -> str:
            nonlocal saved
            if done != saved:
                self.checkpoints.save(self, done)
                saved = done
            return f"checkpoint {self.checkpoints.path(done)}" if done else "no checkpoint (no step was trained)"

        def next_batch(done: int):
            try:
                return meter.wait(rows.next)
            except reader.DamagedRow as exc:
                if self.env.world_size > 1:  # the other ranks cannot join a save from here
                    raise
                if done > start_step and done % cfg.log_every == 0:  # staged before its step's record: write it
                    log.write(meter.read(done))
                how = "rerun with --resume" if done else "rerun"
                raise DflashError(
                    f"{exc}; stopped after step {done} with {checkpoint(done)}: {how} (with --max-damaged-rows N "
                    "to skip such rows, or after repairing the store)"
                ) from None

        def validation(done: int, log_step: bool):
            """A mid-run validation. A damaged held-out row (raised on every rank, see validate) stops the run with
            this step's train record written and its checkpoint; the resume validates that step first."""
            try:
                log.write(meter.set_aside(lambda: self.validate(done)))
            except reader.DamagedRow as exc:
                if log_step:
                    log.write(meter.read(done))
                raise DflashError(
                    f"{exc}; stopped after step {done} with {checkpoint(done)}: rerun with --resume (with "
                    "--max-damaged-rows N to skip such rows, or after repairing the store)"
                ) from None

        try:
            with graph.no_recompiles(), StopSignals() as stop:
                if validate_first:
                    validation(start_step, log_step=False)
                self.feed.stage(next_batch(start_step))
                for step in range(start_step, self.total_steps):
                    self.feed.commit()
                    self.train_step()
                    done = step + 1
                    log_step = done % cfg.log_every == 0 or done == self.total_steps
                    if self.validation_due(done):  # before staging: validation uses the same staging buffers
                        validation(done, log_step)
                    if done < self.total_steps:
                        # Queued right behind the step: the copy overlaps its compute.
                        self.feed.stage(next_batch(done))
                    if log_step:
                        log.write(meter.read(done))
                    if done % cfg.ckpt_every == 0 or done == self.total_steps:
                        checkpoint(done)
                    # One process checks its flag every step (host only); ranks agree on it at log steps, where
                    # the record's read already synchronises, so that every rank stops after the same step.
                    if self.env.world_size == 1 or log_step:
                        # 0: go on, 1: a signal, 2: a damaged row past the limit (several ranks: see DamagedRows)
                        code = 2 if self.damaged.fatal is not None else int(stop.received is not None)
                        code = max_over_ranks(code, self.env.world_size, self.device)
                        if code:
                            raise stop_error(
                                code, self.damaged.fatal, stop.received, done, self.total_steps, checkpoint(done)
                            )
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
        val = self.val_tally
        val.sums.zero_()
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
        layout = val.layout
        val.sums[layout["replay_rounds"]] += rounds
        val.sums[layout["replay_tokens"]] += tokens
        val.sums[layout["damaged_rows"]] += self.damaged.take_new()
        if self.damaged.defer and any_rank(self.damaged.fatal is not None, self.env.world_size, self.device):
            raise self.damaged.fatal or reader.DamagedRow("another rank met a damaged held-out row (its log names it)")
        if self.env.world_size > 1:
            dist.all_reduce(val.sums)
        totals = val.sums.tolist()
        return val.record(totals, "val", step) if totals[layout["blocks"]] else None

    def _reader(self, store, steps, shape: reader.BatchShape) -> reader.RowReader:
        cfg = self.cfg
        derive = self._embed_row if self.host_embedding else None
        return reader.RowReader(
            store,
            steps,
            shape,
            depth=cfg.prefetch,
            workers=cfg.reader_workers,
            pin=self.cuda,
            damaged=self.damaged,
            derive=derive,
        )

    def _embed_row(self, row: dict[str, np.ndarray]):
        """--embedding host, in a reader thread: the row's token embeddings, looked up in the host table."""
        np.take(self.host_table, row["input_ids"], axis=0, out=row["token_embeds"])


# ---------------------------------------------------------------------------------------------- entry points
