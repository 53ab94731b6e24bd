"""Streams store rows into the trainer's static step buffers.

Three pieces, each with one job:
- `split_rows` / `epoch_order` / `DataPlan`: which rows, in which order, with which anchor keys. Pure functions of
  (seed, epoch, rank, world_size), so a resumed run and a run on another number of ranks see the same global
  batches.
- `RowReader`: CPU threads decode rows straight into pinned host batches (`Store.read_row_into`), a
  bounded number of steps ahead. No GPU work happens off the main thread.
- `DeviceFeed`: the main thread copies a host batch to the device on a side stream into staging buffers while
  the previous step runs, then into the static buffers just before the next step (event-synchronised).
"""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dflash.errors import DflashError

logger = logging.getLogger("dflash")

# The torch dtype each stored dtype travels in. bf16 hidden states (uint16 bits in the store) travel as
# bfloat16 and fp8 ones as their uint8 bits, so that every device copy is a plain byte copy.
TRAVEL_DTYPES = {
    np.dtype(np.uint16): torch.bfloat16,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float16): torch.float16,
}
_SPLIT_SEED = 0x5D1F  # the held-out split must not move when the training seed changes


def split_rows(num_rows: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows), both sorted. Deterministic in (num_rows, val_fraction) alone."""
    n_val = int(round(num_rows * val_fraction))
    if val_fraction > 0 and n_val == 0 and num_rows > 1:
        n_val = 1
    val = np.sort(np.random.default_rng(_SPLIT_SEED).permutation(num_rows)[:n_val])
    train = np.ones(num_rows, bool)
    train[val] = False
    return np.flatnonzero(train), val  # the sorted training rows without sorting them: a startup cost per row


def epoch_order(rows: np.ndarray, seed: int, epoch: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's rows for `epoch`: a strided slice of one permutation shared by all ranks.

    Striding (rank r takes positions r, r+world_size, ...) rather than contiguous slices keeps the union of the
    ranks' k-th steps equal to the k-th step of one process that takes `world_size` times as many rows per step,
    so the global batches do not depend on the number of ranks. The remainder is dropped so that every rank
    runs the same number of steps.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(len(rows))
    per_rank = len(rows) // world_size
    return rows[perm[rank : per_rank * world_size : world_size]]  # gathers this rank's rows only


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
    world_size: int

    @property
    def steps_per_epoch(self) -> int:
        return (len(self.train_rows) // self.world_size) // self.rows_per_step

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
                order = epoch_order(self.train_rows, self.seed, epoch, self.rank, self.world_size)
                order_epoch = epoch
            rows = order[i : i + self.rows_per_step]
            yield rows, _row_keys(self.seed, epoch, rows)

    def val_batches(self, rows_per_batch: int):
        """This rank's held-out rows in batches (with row keys, which validation's anchors do not use)."""
        mine = self.val_rows[self.rank :: self.world_size]
        for i in range(0, len(mine), rows_per_batch):
            rows = mine[i : i + rows_per_batch]
            yield rows, _row_keys(self.seed, -1, rows)  # -1: a key of its own, never a training epoch


def row_fields(row_layout: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A store's row arrays (`Store.row_layout`: name -> (shape, numpy dtype), and any of its `teacher_layout`
    the trainer reads) as the tensors they travel in."""
    return {name: (shape, TRAVEL_DTYPES[np.dtype(dtype)]) for name, (shape, dtype) in row_layout.items()}


@dataclass(frozen=True)
class BatchShape:
    micro_batches: int  # gradient-accumulation micro-steps per step
    rows: int  # rows per micro-step
    fields: dict  # row array -> (shape of one row's array, travel dtype): `row_fields` of the store

    @property
    def tokens(self) -> int:
        return self.fields["input_ids"][0][0]

    def field_shape(self, name: str) -> tuple[int, ...]:
        return (self.micro_batches, self.rows, *self.fields[name][0])

    @property
    def rows_per_step(self) -> int:
        return self.micro_batches * self.rows


def allocate_batch(shape: BatchShape, device, pin: bool = False) -> dict[str, torch.Tensor]:
    """Zeroed buffers for one step's rows; `pin` (host only) makes them page-locked for asynchronous copies."""
    shapes = {name: (shape.field_shape(name), dtype) for name, (_, dtype) in shape.fields.items()}
    # The anchor generator's seed for each row (see _row_keys).
    shapes["anchor_keys"] = ((shape.micro_batches, shape.rows), torch.int64)
    return {name: torch.zeros(s, dtype=dtype, device=device, pin_memory=pin) for name, (s, dtype) in shapes.items()}


class DamagedRow(DflashError):
    """A store row could not be read (failed checksum, missing chunk, codec error) and may not be skipped."""


class DamagedRows:
    """The damaged rows met by this rank's readers, and how many may be skipped (`--max-damaged-rows`). A skipped
    row's slot is zeroed: loss mask 0 and doc ids -1 give it no anchor and no loss weight, shapes unchanged."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self.rows: list[int] = []
        # Several ranks cannot stop on one rank's error: there a row past the limit is zeroed too and kept here,
        # and the trainer stops every rank at the next log step (where they agree) with a checkpoint.
        self.defer = False
        self.fatal: DamagedRow | None = None
        self.reported = 0  # rows already counted in a metrics record
        self._lock = threading.Lock()

    def met(self, row: int, exc: DflashError):
        """Record a damaged row; raises DamagedRow when it may not be skipped."""
        with self._lock:
            if len(self.rows) >= self.limit:
                allowed = f"the {self.limit} damaged rows allowed are used up; " if self.limit else ""
                error = DamagedRow(f"{exc} ({allowed}--max-damaged-rows N skips up to N such rows)")
                if not self.defer:
                    raise error from exc
                self.fatal = self.fatal or error
                return
            self.rows.append(row)
            count = len(self.rows)
        logger.warning("skipping damaged row %d (%d of at most %d): %s", row, count, self.limit, exc)

    def take_new(self) -> int:
        """Rows skipped since the last call (for the next metrics record)."""
        with self._lock:
            new, self.reported = len(self.rows) - self.reported, len(self.rows)
        return new


def numpy_view(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: view the bits as int16 so that the store's uint16 bits land unchanged.
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


@dataclass
class HostBatch:
    tensors: dict[str, torch.Tensor]  # host buffers, [micro_batches, rows, ...]; only the first `micro` are filled
    micro: int
    slot: int  # the reader's host slot these buffers are
    reads: list[tuple[int, int, list[Future]]]  # (row i of the batch, store row, the futures of its pieces)
    release: Callable[[], None]  # hands the buffers back to the reader once the device copy has finished


class RowReader:
    """Reads the rows of `steps` (per step: row ids, anchor keys) into pinned host batches, `depth` steps ahead.

    A feeder thread claims a free host slot for the next step and hands its rows to a small pool of reader
    threads; `next()` returns the batches in order. At most `depth` batches are read ahead, so host memory is
    bounded and nothing is read until it is about to be used (the first step waits for one batch, whatever
    the size of the store). A step of fewer rows than threads has each row read in `pieces` interleaved sets of
    its chunks, one thread each: a long row (32768 tokens of a 4B-class target's features: 839 MB) is otherwise
    decoded by one thread while the others idle. `derive(row arrays)`, where given, fills a row's derived arrays
    (those of `shape.fields` the store does not hold) from its read ones, in a reader thread once its pieces are in.
    """

    def __init__(
        self,
        store,
        steps,
        shape: BatchShape,
        depth: int = 2,
        workers: int = 4,
        pin: bool = False,
        damaged: DamagedRows | None = None,
        pieces: int | None = None,
        derive: Callable[[dict[str, np.ndarray]], None] | None = None,
    ):
        self.store, self.shape, self.derive = store, shape, derive
        self.damaged = DamagedRows() if damaged is None else damaged
        self.slots = [allocate_batch(shape, "cpu", pin=pin) for _ in range(depth + 1)]
        self._views = [{name: numpy_view(t) for name, t in slot.items()} for slot in self.slots]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.slots)):
            self._free.put(i)
        self._ready: queue.Queue[HostBatch | BaseException | None] = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dflash-read")
        self.pieces = pieces or max(1, workers // shape.rows_per_step)  # 1: each row in one thread
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, args=(iter(steps),), name="dflash-feed", daemon=True)
        self._feeder.start()

    def _feed(self, steps):
        try:
            for rows, keys in steps:
                slot = self._claim()
                if slot is None:
                    return
                views = self._views[slot]
                views["anchor_keys"].reshape(-1)[: len(keys)] = keys
                micro = -(-len(rows) // self.shape.rows)
                # A short last batch (validation) fills its other rows with padding: no anchor lands there.
                views["loss_mask"][:micro].reshape(-1, self.shape.tokens)[len(rows) :] = 0
                views["doc_ids"][:micro].reshape(-1, self.shape.tokens)[len(rows) :] = -1
                reads = [(i, int(row), self._submit_pieces(slot, i, int(row))) for i, row in enumerate(rows)]
                self._ready.put(HostBatch(self.slots[slot], micro, slot, reads, lambda slot=slot: self._free.put(slot)))
            self._ready.put(None)
        except BaseException as exc:  # handed to the main thread, which raises it
            self._ready.put(exc)

    def _claim(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _submit_pieces(self, slot: int, i: int, row: int) -> list[Future]:
        futures = [self._pool.submit(self._read_piece, slot, i, row, piece) for piece in range(self.pieces)]
        if self.derive is not None:
            # Queued after the row's pieces in the pool's FIFO queue, so the pieces it waits for have all been taken
            # by threads before it runs: no wait on a task that needs its thread.
            futures.append(self._pool.submit(self._derive_row, slot, i, futures[:]))
        return futures

    def _derive_row(self, slot: int, i: int, pieces: list[Future]) -> None:
        if any(future.result() is not None for future in pieces):
            return None  # a damaged row: next() zeroes all of its arrays
        out, _ = self._row_views(slot, i)
        self.derive(out)
        return None

    def _row_views(self, slot: int, i: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The slot's arrays for its row i: (row arrays, teacher arrays)."""
        micro, r = divmod(i, self.shape.rows)
        views = self._views[slot]
        out = {name: views[name][micro, r] for name in self.shape.fields}
        return out, {name: out.pop(name) for name in self.store.teacher_layout if name in out}

    def _read_piece(self, slot: int, i: int, row: int, piece: int) -> DflashError | None:
        """One piece of a row into the slot; a damaged chunk is returned, for next() to judge the whole row."""
        out, teacher = self._row_views(slot, i)
        try:
            self.store.read_row_into(row, out, piece, self.pieces)
            if teacher:
                self.store.read_teacher_into(row, teacher, piece, self.pieces)
        except DflashError as exc:
            return exc
        return None

    def next(self) -> HostBatch | None:
        """The next step's batch, fully read (None after the last step); raises a reader error here."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        if item is not None:
            for i, row, futures in item.reads:
                errors = [error for future in futures if (error := future.result()) is not None]
                if errors:  # judged once per row, after all of its pieces were written
                    self.damaged.met(row, errors[0])  # raises unless the row may be skipped
                    out, teacher = self._row_views(item.slot, i)
                    for name, view in {**out, **teacher}.items():
                        view[...] = -1 if name == "doc_ids" else 0
        return item

    def close(self):
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._feeder.join()


class DeviceFeed:
    """Copies host batches into the static buffers of the step, overlapping the transfer with compute.

    `stage(batch)` queues the host-to-device copy on a side stream into staging buffers (it runs while the
    step already queued computes); `commit()` makes the main stream wait for it and copies staging into the
    static buffers, which the step reads. The static buffers are only ever written by `commit`, on the main
    stream, so a copy cannot race the step that reads them. Made once per trainer: the staging buffers are
    part of the flat memory footprint. On the CPU, `stage` copies straight into the static buffers.
    """

    def __init__(self, static: dict[str, torch.Tensor]):
        self.static = static
        self.device = next(iter(static.values())).device
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.staging = {name: torch.empty_like(t) for name, t in static.items()}
            self.side = torch.cuda.Stream(self.device)
            self.staged = torch.cuda.Event()
            self.consumed = torch.cuda.Event()
        self._in_flight: HostBatch | None = None  # host batch whose copy may still be running
        self._micro = 0

    def stage(self, batch: HostBatch):
        self.drain()
        for name, t in self.static.items():
            host = batch.tensors[name]
            if host.shape[1:] != t.shape[1:] or host.dtype != t.dtype or batch.micro > t.shape[0]:
                raise DflashError(
                    f"host batch {name} is {tuple(host.shape)} {host.dtype}, the step reads {tuple(t.shape)} {t.dtype}"
                )
        self._micro = batch.micro
        if not self.cuda:
            self._copy(self.static, batch.tensors)
            batch.release()
            return
        self.side.wait_event(self.consumed)  # staging is free once the last commit has read it
        with torch.cuda.stream(self.side):
            self._copy(self.staging, batch.tensors, non_blocking=True)
            self.staged.record(self.side)
        self._in_flight = batch

    def commit(self):
        if not self.cuda:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_event(self.staged)
        self._copy(self.static, self.staging)
        self.consumed.record(main)

    def _copy(self, dst, src, non_blocking=False):
        m = self._micro
        for name, t in dst.items():
            t[:m].copy_(src[name][:m], non_blocking=non_blocking)

    def drain(self):
        """Hand the in-flight host batch back once its copy is done.

        This is the loop's flow control: that copy waited for the commit before it, so the host stays at most
        two steps ahead of the device, and a pinned buffer is never rewritten while the DMA reads it.
        """
        if self._in_flight is not None:
            self.staged.synchronize()
            self._in_flight.release()
            self._in_flight = None
