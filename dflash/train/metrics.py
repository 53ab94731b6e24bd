"""Training metrics: the layout of the device sums, the meter that turns them into records (MFU from the FLOPs
dflash.drafter.flops counts), and the log sinks.

The captured step adds its sums into one float64 device vector (`SumsLayout` names its entries); a log step reads
that vector once (the only host sync of the loop), all-reduced over the ranks, and `Meter` turns it into one
record. Field meanings and the MFU formula are in docs/training.md.
"""

import contextlib
import glob
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash.drafter import graph
from dflash.drafter.flops import step_flops_by_kind
from dflash.errors import DflashError
from dflash.leftovers import owner_tag, remove_dead

logger = logging.getLogger("dflash")

METRICS_FILE = "metrics.jsonl"


class SumsLayout:
    """Names of the entries of the float64 metric sums (one vector: one device-to-host read per log)."""

    def __init__(self, block_size: int, sources: int = 0):
        scalars = [
            "loss_sum",
            "weight_sum",
            "accepted",
            "blocks",
            "context_tokens",
            "pairs",
            "grad_norm",
            "steps",
            "replay_rounds",
            "replay_tokens",
            "damaged_rows",
        ]
        self.index = {name: i for i, name in enumerate(scalars)}
        self.correct = slice(len(scalars), len(scalars) + block_size - 1)
        self.counted = slice(self.correct.stop, self.correct.stop + block_size - 1)
        # per data source (a store of several), `SOURCE_SUMS` of each, one after the other
        self.sources = sources
        self.per_source = slice(self.counted.stop, self.counted.stop + len(SOURCE_SUMS) * sources)
        self.size = self.per_source.stop

    def __getitem__(self, name):
        return self.index[name]

    def zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64, device=device)

    def record(self, sums: list[float], kind: str, step: int, source_names: list[str] = ()) -> dict:
        """The fields every record has (train and val), from the sums read to the host; with the names of the
        store's data sources, the accept length of the blocks of each (those with a block)."""
        correct, counted = sums[self.correct], sums[self.counted]
        record = {
            "kind": kind,
            "step": step,
            "loss": sums[self["loss_sum"]] / max(sums[self["weight_sum"]], 1e-12),
            "accept_len": sums[self["accepted"]] / max(sums[self["blocks"]], 1),
            "acc": [c / max(n, 1) for c, n in zip(correct, counted)],  # accuracy per block position k = 1..B-1
            "blocks": int(sums[self["blocks"]]),
            "damaged_rows": int(sums[self["damaged_rows"]]),  # rows skipped (--max-damaged-rows) since the last one
        }
        if sums[self["replay_rounds"]]:
            rounds = sums[self["replay_rounds"]]
            record.update(tau=sums[self["replay_tokens"]] / rounds, rounds=int(rounds))
        if source_names:
            per_source = np.asarray(sums[self.per_source]).reshape(len(SOURCE_SUMS), self.sources)
            record["sources"] = {
                name: {
                    "loss": loss_sum / max(weight, 1e-12),
                    "accept_len": accepted / blocks,
                    "blocks": int(blocks),
                    "weight": weight,
                }
                for name, (accepted, blocks, loss_sum, weight) in zip(source_names, per_source.T.tolist())
                if blocks
            }
        return record


SOURCE_SUMS = ("accepted", "blocks", "loss_sum", "weight_sum")  # per data source, as the scalars of the same name


@dataclass
class Tally:
    """The metric sums of one kind of step (train or validation) on the device, laid out by `layout`, split by the
    data sources of the store it reads when it has several (`doc_source`: each doc id's source; else None)."""

    layout: SumsLayout
    sums: torch.Tensor
    source_names: list[str]
    doc_source: torch.Tensor | None

    def record(self, totals: list[float], kind: str, step: int) -> dict:
        return self.layout.record(totals, kind, step, self.source_names)


def source_sums(per_block: list[torch.Tensor], sources: torch.Tensor, count: int) -> torch.Tensor:
    """float64 [len(SOURCE_SUMS) * count]: each of the blocks' SOURCE_SUMS values (in that order) summed per data
    source, given each block's source (fixed shapes, device ops only: it runs in the captured step)."""
    zeros = torch.zeros(count, dtype=torch.float64, device=sources.device)
    return torch.cat([zeros.index_add(0, sources, values.double()) for values in per_block])


# ---------------------------------------------------------------------------------------------- meter


class Meter:
    """Turns the trainer's device sums into one metrics record per log step; times the loop and the data waits."""

    def __init__(self, trainer):
        self.trainer = trainer
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
        if self.trainer.cuda:
            torch.cuda.synchronize(self.trainer.device)
        t0 = time.perf_counter()
        result = fn()
        self.last += time.perf_counter() - t0
        return result

    def read(self, step: int) -> dict:
        trainer, world_size = self.trainer, self.trainer.env.world_size
        new_damaged = trainer.damaged.take_new()
        tally = trainer.train_tally
        if new_damaged:  # counted on the host by the readers
            tally.sums[tally.layout["damaged_rows"]] += new_damaged
        if world_size > 1:  # sums over all ranks: the record describes the global batch
            dist.all_reduce(tally.sums)
        sums = tally.sums.tolist()  # the one host sync of a log step
        tally.sums.zero_()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        layout, B = tally.layout, trainer.block_size
        steps = max(sums[layout["steps"]], 1)  # summed over ranks, like grad_norm
        record = tally.record(sums, "train", step)
        labelled = sum(sums[layout.counted])
        drafted = sums[layout["blocks"]] * B
        lifted = trainer.encoding.width if trainer.lift is not None else 0
        teacher_rows = labelled if trainer.teacher_kind == "hidden" else 0
        by_kind = step_flops_by_kind(
            trainer.dcfg, sums[layout["context_tokens"]], drafted, labelled, sums[layout["pairs"]], lifted, teacher_rows
        )
        flops = sum(by_kind.values())
        peak = world_size * trainer.cfg.peak_tflops * 1e12
        record.update(
            total_steps=trainer.total_steps,
            epoch=trainer.plan.position(step - 1)[0],
            lr=float(trainer.lr_t),
            grad_norm=sums[layout["grad_norm"]] / steps,
            step_ms=1000 * elapsed / (steps / world_size),
            context_tok_s=sums[layout["context_tokens"]] / elapsed,
            drafted_tok_s=labelled / elapsed,
            mfu=flops / elapsed / peak if trainer.cuda else None,
            step_tflop={kind: f / 1e12 / steps for kind, f in by_kind.items()},  # counted, per step of one rank
            data_wait=self.waited / elapsed,
            recompiles=graph.compiled_graphs() - trainer.compiled_graphs,
        )
        self.waited = 0.0
        if trainer.cuda:
            device = trainer.device
            mem = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
            self.memory.append(mem)
            record.update(mem_allocated=mem[0], mem_reserved=mem[1], mem_peak=torch.cuda.max_memory_allocated(device))
        self.records.append(record)
        return record

    def summary(self) -> dict:
        out = {"records": self.records}
        if self.memory:
            allocated, reserved = zip(*self.memory)
            out.update(allocated_spread=max(allocated) - min(allocated), reserved_spread=max(reserved) - min(reserved))
        return out


# ---------------------------------------------------------------------------------------------- sinks


class MetricsLog:
    """One console line per record (rank 0), `metrics.jsonl`, and TensorBoard scalars under `tb/`."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.jsonl = (out / METRICS_FILE).open("a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"))

    def write(self, record: dict | None):
        if not self.enabled or record is None:
            return
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as exc:
            raise self._failed(exc) from None
        logger.info(format_record(record))
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            for k, value in enumerate(record["acc"], start=1):
                self.tb.add_scalar(f"{record['kind']}/acc_k{k:02d}", value, record["step"])

    def _failed(self, exc: OSError) -> Exception:
        """The error of a failed write; the file is closed and dropped, so that `close` (in a finally) cannot
        replace it with the same OSError from flushing what is still buffered. A torn last line is dropped on
        resume."""
        from dflash.errors import DISK_ERRORS, disk_error

        path, jsonl, self.jsonl = Path(self.jsonl.name), self.jsonl, None
        with contextlib.suppress(OSError):
            jsonl.close()
        if exc.errno not in DISK_ERRORS:
            return DflashError(f"writing {path} failed: {exc.strerror or exc}; fix that and rerun with --resume")
        return disk_error(exc, f"writing {METRICS_FILE} failed", path.parent)

    def close(self):
        if self.jsonl is not None:
            try:
                self.jsonl.close()
            except OSError as exc:
                raise self._failed(exc) from None
        if self.tb is not None:
            self.tb.close()


def format_record(r: dict) -> str:
    accuracy = r["acc"]
    head = (
        f"{r['kind']} step {r['step']}: loss {r['loss']:.4f} accept {r['accept_len']:.2f} "
        f"acc k1 {accuracy[0]:.3f} k{len(accuracy)} {accuracy[-1]:.3f}"
    )
    damaged = f" | skipped {r['damaged_rows']} damaged row(s)" if r.get("damaged_rows") else ""
    if r["kind"] != "train":
        tau = f" tau {r['tau']:.2f} ({r['rounds']} rounds)" if "tau" in r else ""
        return head + f"{tau} ({r['blocks']} blocks){damaged}"
    mfu = f" mfu {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    mem = f" mem {r['mem_allocated'] / 2**30:.1f}/{r['mem_reserved'] / 2**30:.1f} GiB" if "mem_allocated" in r else ""
    left = r.get("total_steps", r["step"]) - r["step"]
    eta = f" | ETA {_clock(left * r['step_ms'] / 1000)}" if left > 0 else ""
    return (
        f"{head} | lr {r['lr']:.2e} gnorm {r['grad_norm']:.2f} | {r['step_ms']:.0f} ms/step "
        f"ctx {r['context_tok_s']:.0f} tok/s drafted {r['drafted_tok_s']:.0f} tok/s{mfu} "
        f"wait {100 * r['data_wait']:.1f}%{mem} recompiles {r['recompiles']}{damaged}{eta}"
    )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def read_records(out: Path) -> list[dict]:
    """The records of RUN/metrics.jsonl. A torn last line (the process died while writing it) is dropped; any other
    line that is not a record is an error naming it."""
    path = Path(out) / METRICS_FILE
    if not path.exists():
        return []
    lines = path.read_bytes().decode(errors="replace").splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a metrics record")
        except ValueError:
            if i == len(lines) - 1:
                logger.warning("dropping the torn last line of %s (the run was stopped while writing it)", path)
                continue
            raise DflashError(
                f"line {i + 1} of {path} is not a metrics record; repair or remove that line, then rerun"
            ) from None
        records.append(record)
    return records


def drop_records_after(out: Path, step: int) -> list[dict]:
    """A resumed run recomputes the steps after its checkpoint: drop the interrupted run's records of them (and a
    torn last line). Returns the records kept; the file is replaced atomically, through a temporary that a resume
    killed while writing it leaves and the next one removes."""
    path = Path(out) / METRICS_FILE
    remove_dead(path.parent.glob(f".{glob.escape(METRICS_FILE)}.*"))
    if not path.exists():
        return []
    kept = [r for r in read_records(out) if r["step"] <= step]
    tmp = path.with_name(f".{METRICS_FILE}.{owner_tag()}")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept
