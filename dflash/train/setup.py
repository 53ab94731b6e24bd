"""What a training run checks and decides before its trainer does any work: the store against its options and its
target (held-out store, self-check, teacher arrays, shapes), the drafter's config, the step's memory, the run
folder, whether a resumed run had already finished; the process's place among the ranks, and its stop signals.

Everything the trainer reads from the store's manifest and the target's files is here (dflash.train builds the
trainer from it).
"""

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash import methods
from dflash.config import TrainConfig
from dflash.device import local_device
from dflash.drafter import DrafterConfig, flash_kv_repeat, loss, memory
from dflash.errors import DflashError, check_not_foreign
from dflash.export import check_export_target
from dflash.locks import LOCK_FILE
from dflash.manifest import Manifest, TargetIdentity, check_same_weights
from dflash.store import Store, target_path
from dflash.target_files import MASK_TOKEN, load_config, load_embedding_and_head
from dflash.train.checkpoint import METRICS_FILE, Checkpointer, on_rank0, read_state
from dflash.train.metrics import SumsLayout, Tally, read_records

logger = logging.getLogger("dflash")

ANCHORS_PER_3072 = 512  # the paper: 512 anchors per 3072-token sequence; scaled with the token budget


# ---------------------------------------------------------------------------------------------- the store's manifest


def check_val_store(cfg: TrainConfig, train: Store, val: Store) -> None:
    """A held-out store is read into the training rows' buffers and scored against the same target: it must share
    the target (its config, its weights and the dtype it ran in), the tapped layers, the tokenizer, the row layout
    and the feature encoding (a subspace store: the very same projection) of the training store, and hold other
    documents."""
    train_path, path = cfg.store, cfg.val_store
    if Path(path).resolve() == Path(train_path).resolve():
        raise DflashError(f"--val-shards {path} is the training store itself; give a store of held-out documents")
    a, b = train.manifest, val.manifest
    differ = [name for name in ("layer_ids", "token_budget") if getattr(a, name) != getattr(b, name)]
    # The tokenizer by content (its name is the path it was read from: the same target elsewhere is the same)
    if (a.tokenizer.vocab_size, a.tokenizer.special_ids) != (b.tokenizer.vocab_size, b.tokenizer.special_ids):
        differ.append("tokenizer (vocabulary size or special token ids)")
    if a.target.config_hash != b.target.config_hash:
        differ.append("target (config hash)")
    if a.fingerprint.get("dtype") != b.fingerprint.get("dtype"):
        differ.append("the dtype the target ran in")
    if (a.features.precision, a.features.width, a.features.scale_groups) != (
        b.features.precision,
        b.features.width,
        b.features.scale_groups,
    ):
        differ.append("the feature encoding (--precision, --subspace, --scale-groups)")
    elif train.projection is not None and not np.array_equal(train.projection, val.projection):
        differ.append(f"the subspace projection (harvest the held-out store with --projection-from {train_path})")
    if differ:
        raise DflashError(
            f"the held-out store {path} differs from the training store in {', '.join(differ)}; harvest the "
            "held-out documents with the same --model, --layers, --token-budget and feature encoding"
        )
    check_same_weights(
        a.target_identity,
        b.target_identity,
        f"the target weights of --val-shards {path} and of the training store",
        "its validation would score another model's features; harvest the held-out documents with the training "
        "store's --model",
        "--allow-other-target-weights",
        cfg.allow_other_target_weights,
    )
    check_held_out(cfg, a, b)


def check_held_out(cfg: TrainConfig, train: Manifest, val: Manifest) -> None:
    """Refuse a held-out store harvested from the training store's data (the same data digest): every one of its
    documents is a training document, so its validation measures recall, not the drafter on unseen text. A refusal,
    not a warning, because the validation records look the same either way and are compared across runs; the
    stores record no digest per document, so a partial overlap (a --limit, a shared source) is not seen."""
    digest = train.fingerprint.get("data_sha256")
    if digest is None or digest != val.fingerprint.get("data_sha256"):
        return
    overlap = (
        f"all {val.counts.documents} documents of --val-shards {cfg.val_store} are training documents: it was "
        f"harvested from the training store's data (data_sha256 {digest[:12]}), so its validation is not held out"
    )
    if not cfg.allow_val_overlap:
        raise DflashError(
            f"{overlap}; harvest other documents for it, or pass --allow-val-overlap to validate on these anyway"
        )
    logger.warning("%s; validating on them as --allow-val-overlap asks", overlap)


def check_self_check(cfg: TrainConfig, store: Store) -> None:
    """A store whose recorded check against its target failed holds features the target does not produce: refuse
    it unless told otherwise."""
    check = store.manifest.self_check
    if check is not None and not check.passed and not cfg.allow_failed_self_check:
        raise DflashError(
            f"the store {store.path} failed its check against the target at harvest ({check.describe()}); its "
            "features are not what the target computes: harvest again, or pass --allow-failed-self-check to train anyway"
        )


def target_path_for(cfg: TrainConfig, store: Store) -> str:
    path = cfg.target or target_path(store.path, store.manifest)
    if cfg.target is None and Path(path).is_absolute() and not Path(path).exists():  # (a hub name is not absolute)
        raise DflashError(
            f"the store was harvested from {path}, which is not here; pass --target the target checkpoint folder"
        )
    return path


# Drafter fields that follow from the store (or from --block-size, and the target's identity from --target): an
# override would train one drafter and export the config of another.
STORE_FIXED_FIELDS = {
    "target_layer_ids",
    "num_target_layers",
    "hidden_size",
    "vocab_size",
    "block_size",
    "target_identity",
}


def check_anchorable(store: Store, span: int, path: str) -> None:
    """A store with no token in the loss, or whose every document is shorter than a block, has no position to
    anchor one: each step would train on nothing and the export be an untrained drafter. Refused before any work
    (the documents table only: a store whose answers all sit in a document's last few tokens is not caught)."""
    counts = store.manifest.counts
    if counts.loss_tokens == 0:
        raise DflashError(
            f"{path} has no token in the loss ({counts.documents} documents, {counts.tokens} tokens): nothing to train "
            "on; harvest data whose answers are in the loss (assistant turns, completions or plain text; docs/data.md)"
        )
    longest = int(store.documents()[:, 4].max(initial=0))
    if longest < span:
        raise DflashError(
            f"no document of {path} holds a block of {span} tokens (the longest has {longest}), so no position can "
            f"anchor one: train with a --block-size whose blocks fit {longest} token{'s' * (longest != 1)}, or harvest "
            "longer documents"
        )


def tally_for(store: Store, block_size: int, device) -> Tally:
    """Zeroed metric sums for the steps over `store`: split by its data sources when it has several, with each doc
    id's source on the device."""
    names, doc_source = [], None
    if store.document_sources is not None and len(store.manifest.sources) > 1:
        names = [source["source"] for source in store.manifest.sources]
        doc_source = torch.from_numpy(store.document_sources.astype(np.int64)).to(device)
    layout = SumsLayout(block_size, len(names))
    return Tally(layout, layout.zeros(device), names, doc_source)


def check_target_weights(cfg: TrainConfig, store: Store, path: str) -> TargetIdentity:
    """The checkpoint whose embedding and LM head the drafter trains with, refused when its weights are not those
    the store's features came from (unless --allow-other-target-weights): the drafter would learn to map one
    model's features into another's embedding space and logits, and nothing in training would show it."""
    target = TargetIdentity.of_checkpoint(path)
    # Without --target: the folder the store records, whose weights may have been rewritten in place since.
    given = f"--target {path}" if cfg.target else f"the store's target {path} now"
    check_same_weights(
        store.manifest.target_identity,
        target,
        f"the weights of {given} and of the target the store {store.path} was harvested from",
        "the drafter would learn another model's embedding and LM head on the store's features; pass --target that "
        "checkpoint",
        "--allow-other-target-weights",
        cfg.allow_other_target_weights,
    )
    return target


def drafter_config(cfg: TrainConfig, store: Store, target_path: str, target: TargetIdentity) -> DrafterConfig:
    """The drafter shaped like the target recorded in the store; --draft-layers and overrides on top; named after
    `target`, the checkpoint it trains with. A version-1 store records no text config: it is read from the target's
    config.json."""
    manifest = store.manifest
    fixed = sorted(set(cfg.drafter_overrides) & STORE_FIXED_FIELDS)
    if fixed:
        raise DflashError(
            f"--drafter-option cannot set {', '.join(fixed)}: the store fixes them (its target's identity, width, "
            "vocabulary and tapped layers); --block-size sets the block size"
        )
    config_cls = methods.get(cfg.method).config_cls
    overrides = dict(cfg.drafter_overrides)
    if cfg.block_size is not None:
        overrides["block_size"] = cfg.block_size
    if "num_anchors" in {f.name for f in dataclasses.fields(config_cls)}:  # a method that records them (DSpark)
        overrides["num_anchors"] = anchors_per_row(cfg, store.token_budget)
    mask = overrides.pop("mask_token_id", manifest.tokenizer.mask_id)
    if mask is None:
        raise DflashError(
            f"the target's tokenizer has no {MASK_TOKEN} token and no mask token id was given; "
            "pass --drafter-option mask_token_id=ID (a token id of the target's vocabulary)"
        )
    text = manifest.target.text_config() if manifest.target.has_text_config else load_config(target_path, "--target")
    overrides["target_identity"] = target.to_record()
    return config_cls.from_target_config(text, list(manifest.layer_ids), mask, num_layers=cfg.draft_layers, **overrides)


def anchors_per_row(cfg: TrainConfig, token_budget: int) -> int:
    return cfg.anchors or default_anchors(token_budget)


def default_anchors(token_budget: int) -> int:
    """Train's anchors per row without --anchors: the paper's density, scaled to the store's token budget."""
    return max(1, round(token_budget * ANCHORS_PER_3072 / 3072))


def load_frozen(path: str, manifest: Manifest) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head, checked against the vocabulary and width the store was made with."""
    embed, head = load_embedding_and_head(path)
    want = (manifest.target.vocab_size, manifest.target.hidden_size)
    for name, w in (("embedding", embed), ("LM head", head)):
        if tuple(w.shape) != want:
            raise DflashError(
                f"the {name} of {path} is {tuple(w.shape)} but the store was harvested from a target with "
                f"vocabulary {want[0]} and hidden size {want[1]}; pass --target the checkpoint the store was made from"
            )
    return embed, head


def check_teacher(method: methods.Method, store: Store, path: str, teacher_loss: str, required=False) -> dict:
    """The teacher arrays a method trains from ({} when it trains on hard labels), or a refusal for a store without
    them where the method (or `required`: the training store's teacher, for its validation store) needs them."""
    optional = method.teacher == "optional" and teacher_loss == "auto" and store.teacher is not None
    if not (optional or required or method.teacher == "required"):
        return {}
    if store.teacher is None:
        raise DflashError(
            f"--method {method.name} trains against the target's next-token distribution, which {path} does not "
            "hold: harvest it with --teacher hidden (exact, H bf16 values per token) or --teacher topk:K (K + 1 "
            "probabilities and K ids per token)"
            + (" as the training store was; or train on hard labels: --teacher-loss off" if required else "")
        )
    return store.teacher_layout


def describe_objective(method: methods.Method, store: Store, teacher_loss: str, with_teacher: bool) -> str:
    """The log line of what the drafter is trained against."""
    if with_teacher:
        return f"--method {method.name} trains against the target's distribution (the store's {store.teacher.name} teacher)"
    if method.teacher != "optional":
        return f"--method {method.name} trains on the store's tokens"
    why = "--teacher-loss off" if teacher_loss == "off" else "the store holds no teacher"
    return (
        f"--method {method.name} trains on hard labels ({why}): it learns the target's argmax, what serving at "
        "temperature 0 verifies; for sampled serving train --method dspark from a --teacher topk:32 store, for both "
        "temperatures --method dflash2 from such a store with --drafter-option selector_top_k=64 (README, 'Which to "
        "use')"
    )


def check_step_memory(
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    method,
    fields: dict,
    anchors: int,
    lifted_width: int,
    device,
    teacher: str | None = None,
    embedding_on_host: bool = False,
) -> int:
    """The estimated peak bytes of a step (dflash.drafter.memory), refused before anything is built when the device has
    less (unless --ignore-memory-estimate); `teacher`: the kind of teacher arrays the method trains from; `fields`:
    the store's row arrays (the token embeddings of `embedding_on_host` are counted apart)."""
    T = fields["input_ids"][0][0]
    shape = memory.StepShape(
        rows=cfg.rows_per_step,
        micro_batches=cfg.grad_accum,
        token_budget=T,
        anchors=anchors,
        loss_chunk=cfg.loss_chunk or loss.default_chunk_size(dcfg.vocab_size),
        stored_bytes_per_row=memory.row_bytes(fields),
        parameters=memory.parameter_count(method.model_cls, dcfg),
        lifted_width=lifted_width,
        cuda=device.type == "cuda",
        teacher=teacher,
        recompute=cfg.recompute,
        layer_parameters=memory.parameter_count(method.model_cls, dcfg, layers_only=True),
        embedding_on_host=embedding_on_host,
        kv_repeat=flash_kv_repeat(dcfg.num_attention_heads, dcfg.num_key_value_heads, cfg.attention_kernel_options),
    )
    if cfg.ignore_memory_estimate:
        available = None
    else:  # on the CPU the step's memory is the host's, which its ranks share
        available = memory.host_share() if device.type == "cpu" else memory.available_memory(device)
    return memory.check_memory(dcfg, shape, available, device)


def check_host_memory(cfg: TrainConfig, fields: dict, host_table_bytes: int, device) -> int:
    """The host memory a GPU run's readers pin, refused before any work when this rank's share of the host's
    available memory is smaller (unless --ignore-memory-estimate): `prefetch` + 1 page-locked batches of the step's
    rows (`fields`, token embeddings included with --embedding host), as many of the held-out rows while a mid-run
    validation reads (--val-every), and the host embedding table. At long rows these are the large part: a
    262144-token row of a 27B-class target's 5 tapped layers is 13.4 GB. Returns the bytes."""
    row = memory.row_bytes(fields)
    batches = cfg.grad_accum * cfg.rows_per_step + (cfg.rows_per_step if cfg.val_every else 0)
    need = (cfg.prefetch + 1) * batches * row + host_table_bytes
    if device.type != "cuda" or cfg.ignore_memory_estimate:
        return need
    share = memory.host_share()
    if share is None or need <= share:
        return need
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    shared = f" / {ranks} ranks on this host" if ranks > 1 else ""
    raise DflashError(
        f"the reader's page-locked host batches need about {memory.format_bytes(need)} ({cfg.prefetch + 1} batches "
        f"of {batches} rows of {memory.format_bytes(row)}, --prefetch {cfg.prefetch} steps ahead"
        f"{', with the held-out rows of --val-every' if cfg.val_every else ''}"
        f"{', and the host embedding table' if host_table_bytes else ''}) but this rank has "
        f"{memory.format_bytes(share)} of host memory (MemAvailable{shared}): lower --prefetch (1 reads "
        "one step ahead), --rows-per-step or --grad-accum, run fewer ranks on this host, or harvest shorter rows; "
        "--ignore-memory-estimate runs it anyway"
    )


def describe_embedding(on_host: bool, choice: str, table: torch.Tensor, step_tokens: int) -> str:
    """The log line of TrainConfig.embedding: where the token embeddings are looked up, and what it costs."""
    table_bytes = table.numel() * table.element_size()
    if not on_host:
        return f"token embeddings: the {memory.format_bytes(table_bytes)} table on the device (--embedding {choice})"
    shipped = step_tokens * table.shape[1] * table.element_size()
    return (
        f"token embeddings: looked up on the host by the reader threads (--embedding {choice}): the "
        f"{memory.format_bytes(table_bytes)} table stays in host memory, {memory.format_bytes(shipped)} of embeddings travel with a step's rows"
    )


def check_shapes(token_budget: int, anchors: int, feature_dim: int, dcfg: DrafterConfig):
    """A row of `token_budget` tokens holds `anchors` blocks of the drafter, whose fc takes `feature_dim` features
    (train's checks, and plan's of the run it prices)."""
    B = dcfg.span  # the tokens a block covers, from its anchor to its last draft
    if dcfg.drafts_per_block < 1:
        least = dcfg.block_size - dcfg.drafts_per_block + 1
        raise DflashError(f"--block-size {dcfg.block_size} drafts no token; give --block-size {least} or more")
    if token_budget < B:
        raise DflashError(
            f"a row of the store holds {token_budget} tokens, which cannot hold a block of {dcfg.block_size} "
            f"({dcfg.drafts_per_block} drafts, {B} tokens from its anchor); use a smaller --block-size, or a store "
            "of a larger --token-budget"
        )
    if not 1 <= anchors <= token_budget - B + 1:
        raise DflashError(
            f"--anchors {anchors} cannot fit a {token_budget}-token row with blocks of {B} tokens "
            f"(at most {token_budget - B + 1}); lower --anchors"
        )
    if feature_dim != dcfg.feature_dim:
        raise DflashError(
            f"the store's features are {feature_dim} wide but the drafter fuses {dcfg.feature_dim} "
            f"({len(dcfg.target_layer_ids)} layers x {dcfg.hidden_size}); the store's manifest and target do not match"
        )


# ---------------------------------------------------------------------------------------------- environment


class StopSignals:
    """SIGINT / SIGTERM while training: ask the loop to stop after the current step with a checkpoint. The first
    signal puts the previous handlers back, so a second one stops at once (losing the steps since the last
    checkpoint). Handlers can only be set from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name
        self._restore()
        logger.warning("%s: saving a checkpoint after this step, then stopping (again: stop at once)", self.received)

    def _restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None) -> Env:
    """One process per device under torchrun (RANK / WORLD_SIZE / LOCAL_RANK); NCCL on CUDA, gloo on the CPU."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank != 0 and logger.getEffectiveLevel() < logging.WARNING:
        logger.setLevel(logging.WARNING)  # their info lines would repeat rank 0's; warnings and errors are their own
    dev = local_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        # The codebook gathers' backward (DFlash 2's selector, DSpark's W1) accumulates rows with atomic adds in
        # inductor's threaded CPU code, so two runs differed in the last bits at 2 threads; the deterministic
        # kernels keep a CPU run, and its resume, bit-exact (on a GPU the step stays on the fast ones).
        torch.use_deterministic_algorithms(True, warn_only=True)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        device_id = dev if dev.type == "cuda" else None
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device_id)
    return Env(rank, world_size, dev)


def stop_error(code: int, fatal, signame: str | None, done: int, total: int, where: str) -> DflashError:
    """The error that ends a run stopped between steps (all ranks agreeing), saying how to go on: code 2 for a
    damaged row (`fatal`: this rank's, None for another rank's), else a signal; `where`: the checkpoint saved."""
    if code == 2:
        what = f"{fatal}" if fatal is not None else "another rank met a damaged row (its log names it)"
        return DflashError(
            f"{what}; stopped after step {done} with {where} (the steps since the row was read trained without "
            "it); rerun with --resume (with --max-damaged-rows N to skip such rows, or after repairing the store)"
        )
    cause = signame or "a signal to another rank"
    if done == total:  # a stop was asked for: not the final validation's wait, which can be long
        return DflashError(
            f"stopped by {cause} after the last step ({done} of {done}), {where} saved, before the final "
            "validation and the export; the same command with --resume runs them"
        )
    return DflashError(
        f"stopped by {cause} after step {done} of {total}, {where} saved; continue with the same command and --resume"
    )


# ---------------------------------------------------------------------------------------------- the run folder


def final_validation(out: Path, step: int) -> dict | None:
    """The final validation record of a finished run (resumed again: it is not computed and written twice)."""
    final = [r for r in read_records(out) if r["kind"] == "val" and r["step"] == step]
    return final[-1] if final else None


def finished_run(cfg: TrainConfig, env: Env, out: Path, checkpoint: Path | None) -> dict | None:
    """The result of resuming a run that had finished (its last checkpoint and its final validation written), said
    before any work: its drafter exported again (from the checkpoint) when --export; None for a run not finished."""
    state = read_state(checkpoint) if checkpoint is not None else None
    if state is None or state["step"] < state["total_steps"]:
        return None
    val = on_rank0(env.rank, env.world_size, lambda: final_validation(out, state["step"]))
    if val is None:  # its final validation failed (a damaged held-out row): the trainer runs it again
        return None
    logger.info(
        "%s finished all its %d steps (checkpoint %s): nothing left to train. It cannot be extended exactly (the "
        "learning rate's schedule spans the total steps): to train longer, train into a new --out with more "
        "--max-steps or --epochs",
        out,
        state["step"],
        checkpoint.name,
    )
    result = {"records": [], "val": val, "damaged_rows": [], "finished": True}
    if cfg.export:

        def export() -> str:
            drafter = Checkpointer(out).export(
                out / "drafter",
                dtype=cfg.export_dtype,
                force=True,
                with_target_embeddings=cfg.export_with_target_embeddings,
                target=cfg.target,
            )
            return str(drafter)

        result["export"] = on_rank0(env.rank, env.world_size, export)
    return result


# What a run writes into its folder (docs/training.md), and the hidden files of its writes in progress: the probe of
# check_out, the metrics' rewrite, the lock and the export's lock and temporary folders.
RUN_ENTRIES = {"checkpoints", METRICS_FILE, "tb", "drafter", LOCK_FILE}
RUN_TEMPORARIES = (".write-test-", f".{METRICS_FILE}.", ".drafter.")


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` holds only what a training run writes."""
    return all(p.name in RUN_ENTRIES or p.name.startswith(RUN_TEMPORARIES) for p in folder.iterdir())


def check_out(cfg: TrainConfig) -> Path:
    """The run folder must be a folder (made here), outside the stores, and writable: checked before any work."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise DflashError(f"--out {out} is a file; give --out a folder for the run (checkpoints, metrics, drafter)")
    for flag, store in (("--shards", cfg.store), ("--val-shards", cfg.val_store)):
        if store and (out.resolve() == Path(store).resolve() or Path(store).resolve() in out.resolve().parents):
            raise DflashError(f"--out {out} is inside the store {store} ({flag}); give --out a folder outside it")
    if out.is_dir():  # export's rule: a run never writes among files it did not make
        fix = "give --out a new or empty folder for the run (or the folder of a run to --resume)"
        check_not_foreign(out, is_run_folder, "a dflash training run", fix)
    if cfg.max_damaged_rows < 0:
        raise DflashError(f"--max-damaged-rows {cfg.max_damaged_rows} (must be at least 0)")
    if cfg.export:  # refused now, not after the last step
        check_export_target(out / "drafter", replace_export=True)
    probe = out / f".write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DflashError(f"cannot write to --out {out} ({exc.strerror}); give --out a writable folder") from None
    return out
