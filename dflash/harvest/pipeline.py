"""The forward and write pipeline of one part: per row group, the main thread runs forward batches (documents
sorted by length, one per batch row, right-padded to a multiple of 64, no attention mask), scatters the real
tokens into a device row buffer and starts one copy into pinned host memory on a side stream; a writer thread
(compression and disk only, no GPU work) writes finished groups behind a bounded queue, so in steady state the
GPU never waits for I/O. `PipelineStalls` says how long the forward thread was blocked and on what: a harvest
slower than the bare forward either shows the wait there or loses its time elsewhere (the GIL, the CPU)."""

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from dflash import features, manifest, store
from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest.options import row_bytes
from dflash.packing import PartPlan, batch_shape, forward_batches
from dflash.target import TappedTarget

# Pinned row-group buffers. Two is the pipeline's least (a group is handed to the writer only once the next one's
# copy has started); a third is pinned only when the forward finds none free. Pinning costs about 1 s per GB on the
# GPU machine (2.2 s per buffer of two 32768-token rows of a 27B-class target), paid before the first forward.
HOST_BUFFERS_FIRST, HOST_BUFFERS = 2, 3


@dataclass
class PipelineStalls:
    """Seconds the main thread (the one launching the target's kernels) spent blocked, by cause."""

    groups: int = 0
    setup_s: float = 0.0  # allocating the device row buffers and the first pinned host buffers, once per run
    host_buffers: int = 0  # pinned host buffers in the end (HOST_BUFFERS_FIRST, more when writing fell behind)
    buffer_wait_s: float = 0.0  # no free pinned buffer: writing fell behind the forward (pinning another included)
    # Waiting for the GPU to finish the previous group (and its host copy). Expected: the thread queues one group
    # ahead of the GPU. Near zero means the thread cannot stay ahead and the GPU idles between its kernels.
    gpu_wait_s: float = 0.0
    drain_s: float = 0.0  # after the last group's host copy, until the writer had committed everything

    def describe(self) -> str:
        return (
            f"{self.groups} row groups after {self.setup_s:.1f} s of buffer setup; the forward thread waited "
            f"{self.buffer_wait_s:.1f} s for free host buffers ({self.host_buffers} pinned, "
            f"more when writing falls behind) and {self.gpu_wait_s:.1f} s for the GPU (running a group ahead of it); "
            f"{self.drain_s:.1f} s of writes after the last forward"
        )


@dataclass
class RowGroup:
    first: int
    last: int
    host: dict[str, torch.Tensor]  # hidden [rows, T, W] (bf16 or fp8 bits), scales for fp8; pinned on CUDA
    tokens: dict[str, np.ndarray]
    ready: torch.cuda.Event | None  # the host copy is complete once this fires


class HostBuffers:
    """The pinned row-group buffers in circulation: HOST_BUFFERS_FIRST made up front, one more (up to
    HOST_BUFFERS) whenever the forward asks and none is free, so that a run whose writer keeps up pins no more
    than it uses."""

    def __init__(self, make):
        self.make, self.made, self.free = make, 0, queue.Queue()
        for _ in range(HOST_BUFFERS_FIRST):
            self._add()

    def _add(self):
        self.free.put(self.make())
        self.made += 1

    def get(self) -> dict[str, torch.Tensor]:
        if self.free.empty() and self.made < HOST_BUFFERS:
            self._add()
        return self.free.get()


class RowWriter(threading.Thread):
    """Writes finished row groups and commits them; CPU only. An error stops writing and is raised later."""

    def __init__(self, part: store.PartWriter, free: queue.Queue, on_commit, commit: bool = True):
        super().__init__(daemon=True, name="dflash-writer")
        self.part, self.free, self.on_commit, self.commit = part, free, on_commit, commit
        self.jobs: queue.Queue = queue.Queue()  # bounded in effect by the host buffers in circulation
        self.error: BaseException | None = None

    def run(self):
        while (group := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    n = group.last - group.first
                    host = {name: store_bits(buffer[:n]) for name, buffer in group.host.items()}
                    self.part.write_rows(group.first, host.pop("hidden"), {**host, **group.tokens})
                    if self.commit:  # a repair rewrites rows of a finished part: nothing new to commit
                        self.part.commit(group.last)
                    self.on_commit(group)
                except BaseException as exc:  # handed to the main thread, which raises it
                    self.error = exc
            self.free.put(group.host)  # keep buffers circulating so that the main thread never blocks for ever

    def check(self):
        if self.error is not None:
            raise self.error


class Progress:
    """tqdm bar over tokens (documents vary a lot in length): documents done, tokens/s, MB/s (uncompressed), ETA."""

    def __init__(self, plan: PartPlan, committed_rows: int, row_bytes: int, rank: int):
        counts = plan.counts()
        self.plan, self.row_bytes, self.start, self.bytes = plan, row_bytes, time.perf_counter(), 0
        self.total_docs = counts["documents"]
        self.docs = sum(len(row) for row in plan.rows[:committed_rows])
        self.bar = tqdm(
            total=counts["tokens"],
            initial=plan.row_tokens(0, committed_rows),
            unit="tok",
            unit_scale=True,
            desc=f"harvest rank {rank}",
            dynamic_ncols=True,
            mininterval=1.0,
        )

    def commit(self, group: RowGroup):
        self.docs += sum(len(row) for row in self.plan.rows[group.first : group.last])
        self.bytes += (group.last - group.first) * self.row_bytes
        mb_per_s = self.bytes / 1e6 / (time.perf_counter() - self.start)
        self.bar.set_postfix_str(f"docs {self.docs}/{self.total_docs}, {mb_per_s:.0f} MB/s", refresh=False)
        self.bar.update(self.plan.row_tokens(group.first, group.last))

    def close(self):
        self.bar.close()


class RowEncoder:
    """Turns row groups of full bf16 features into the stored encoding, on their device, into preallocated
    buffers: the identity (a view) for bf16 at full width; the projection P h for a subspace; FP8 bits and
    exponents for fp8."""

    def __init__(self, spec: manifest.FeatureSpec, projection: torch.Tensor | None, shape: tuple[int, int], device):
        self.spec, self.projection = spec, projection
        self.identity = spec.precision == "bf16" and projection is None
        self.shapes = {"hidden": (*shape, spec.width)}
        if spec.precision == "fp8":
            self.shapes["scales"] = (*shape, spec.scale_groups)
        self.dtypes = {"hidden": torch.uint8 if spec.precision == "fp8" else torch.int16, "scales": torch.int8}
        self.device = device

    def buffers(self, pin: bool = False, device=None) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=self.dtypes[name], device=device or "cpu", pin_memory=pin)
            for name, shape in self.shapes.items()
        }

    def encode(self, rows: torch.Tensor, out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """rows bf16 [R, T, n*H] -> the stored arrays (`out` filled, or a view of `rows` for the identity)."""
        if self.identity:
            return {"hidden": rows.view(torch.int16)}
        values = rows if self.projection is None else features.project(rows, self.projection)
        if self.spec.precision == "fp8":
            bits, exponents = features.quantize_fp8(values, self.spec.scale_groups)
            out["hidden"].copy_(bits)
            out["scales"].copy_(exponents)
        else:
            out["hidden"].copy_(values.view(torch.int16))
        return out


class TeacherEncoder:
    """The teacher arrays of row groups, on their device, from the rows of the target's final-normed hidden state
    (`rows()`): its bf16 bits (hidden; a view), or the top-k of the next-token distribution with the tail mass
    computed a chunk of tokens at a time, zeros on padding (topk). Without a teacher it has no arrays."""

    TORCH_DTYPES = {"int32": torch.int32, "float16": torch.float16, "bfloat16": torch.int16}  # bf16 as its bits

    def __init__(self, spec: manifest.TeacherSpec | None, target: TappedTarget, shape: tuple[int, int]):
        self.spec, self.lm_head, self.shape = spec, target.lm_head, shape
        arrays = spec.arrays if spec else {}
        self.shapes = {name: shape if name == "teacher_tail" else (*shape, spec.width) for name in arrays}
        self.dtypes = {name: self.TORCH_DTYPES[dtype] for name, dtype in arrays.items()}
        self.identity = spec is None or spec.kind == "hidden"
        # Stored as bf16 (hidden); the LM head's input in the target's own dtype (topk)
        self.final_dtype = torch.bfloat16 if self.identity else target.dtype
        self.hidden_size = target.info.hidden_size

    def rows(self, device) -> torch.Tensor | None:
        """A zeroed device buffer for the final hidden state of a row group; None without a teacher."""
        if self.spec is None:
            return None
        return torch.zeros(*self.shape, self.hidden_size, dtype=self.final_dtype, device=device)

    def buffers(self, pin: bool = False, device=None) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=self.dtypes[name], device=device or "cpu", pin_memory=pin)
            for name, shape in self.shapes.items()
        }

    def encode(self, final: torch.Tensor | None, doc_ids: np.ndarray, out: dict | None) -> dict[str, torch.Tensor]:
        """final [R, T, H] (its first n = len(doc_ids) rows used), doc_ids [n, T] (-1: padding) -> the stored
        teacher arrays."""
        if self.spec is None:
            return {}
        if self.identity:
            return {"teacher_hidden": final.view(torch.int16)}
        n = len(doc_ids)
        probs, ids, tail = features.next_token_top_k(final[:n].flatten(0, 1), self.lm_head, self.spec.k)
        real = _to_device(doc_ids.reshape(-1) >= 0, final.device)
        for name, values in (("teacher_probs", probs), ("teacher_ids", ids), ("teacher_tail", tail)):
            mask = real if values.dim() == 1 else real[:, None]
            out[name][:n].copy_(torch.where(mask, values, 0).unflatten(0, (n, -1)))
        return out


def store_bits(buffer: torch.Tensor) -> np.ndarray:
    """A host buffer as the numpy dtype the store holds (uint16 for bf16 bits, uint8 for fp8 bits, int8 scales)."""
    array = buffer.numpy()
    return array.view(np.uint16) if array.dtype == np.int16 else array


def run_rows(
    cfg: HarvestConfig,
    plan: PartPlan,
    target: TappedTarget,
    part: store.PartWriter,
    header: manifest.Manifest,
    projection: torch.Tensor | None,
    groups: list[tuple[int, int]] | None = None,
) -> PipelineStalls:
    """Harvest the row groups [first, last) after the committed rows (or `groups`: a repair's, not committed)."""
    spec = header.features
    setup_start = time.perf_counter()
    device, T = torch.device(cfg.device), cfg.token_budget
    F = len(target.layer_ids) * target.info.hidden_size
    rows_per_group = max(1, cfg.forward_tokens // T)
    cuda = device.type == "cuda"
    copy_stream = torch.cuda.Stream(device) if cuda else None
    encoder = RowEncoder(spec, projection, (rows_per_group, T), device)
    teacher = TeacherEncoder(header.teacher, target, (rows_per_group, T))
    # Two device buffers on CUDA: the next group fills one while the other is still being copied to the host.
    device_rows = [torch.zeros(rows_per_group, T, F, dtype=torch.bfloat16, device=device) for _ in range(1 + cuda)]
    final_rows = [teacher.rows(device) for _ in device_rows]
    encoded = [None if encoder.identity else encoder.buffers(device=device) for _ in device_rows]
    teacher_encoded = [None if teacher.identity else teacher.buffers(device=device) for _ in device_rows]
    copied = [None] * len(device_rows)  # event: device buffer k may be overwritten
    # Pinned on the forward thread: pinning on a side thread during the forward was measured no faster end to end
    # (docs/benchmarks.md, Long rows, 2026-12-05), its page locking slowing the forward as much as it saved.
    host_buffers = HostBuffers(lambda: {**encoder.buffers(pin=cuda), **teacher.buffers(pin=cuda)})
    progress = Progress(
        plan, part.rows_committed if groups is None else 0, row_bytes(T, spec, header.teacher), cfg.rank
    )
    writer = RowWriter(part, host_buffers.free, progress.commit, commit=groups is None)
    if groups is None:
        starts = range(part.rows_committed, len(plan.rows), rows_per_group)
        groups = [(first, min(first + rows_per_group, len(plan.rows))) for first in starts]
    writer.start()
    pending, stalls = None, PipelineStalls(setup_s=time.perf_counter() - setup_start)
    try:
        probe_largest_forward(plan, groups, cfg.forward_tokens, target)
        for step, (first, last) in enumerate(groups):
            writer.check()
            stalls.groups += 1
            k = step % len(device_rows)
            if copied[k] is not None:
                torch.cuda.current_stream(device).wait_event(copied[k])
            rows, tokens = device_rows[k], plan.token_arrays(first, last)
            fill_rows(rows, plan, first, last, target, cfg.forward_tokens, final_rows[k])
            teacher_arrays = teacher.encode(final_rows[k], tokens["doc_ids"], teacher_encoded[k])
            stored = {**encoder.encode(rows, encoded[k]), **teacher_arrays}
            t0 = time.perf_counter()
            host = host_buffers.get()  # blocks only when writing falls behind the forward
            stalls.buffer_wait_s += time.perf_counter() - t0
            copied[k] = _copy_to_host(stored, host, last - first, copy_stream)
            group = RowGroup(first, last, host, tokens, copied[k])
            if pending is not None:  # hand over the previous group once its copy is done: one group of lag
                stalls.gpu_wait_s += _submit(writer, pending)
            pending = group
        if pending is not None:
            _submit(writer, pending)  # waits for the last forward and its copy
        writes_left = time.perf_counter()
    finally:
        writer.jobs.put(None)
        writer.join()
        progress.close()
        stalls.host_buffers = host_buffers.made
    stalls.drain_s = time.perf_counter() - writes_left
    writer.check()
    return stalls


def fill_rows(
    rows: torch.Tensor,
    plan: PartPlan,
    first: int,
    last: int,
    target: TappedTarget,
    forward_tokens: int,
    final_rows: torch.Tensor | None = None,
):
    """Run the forward batches of rows [first, last) and place each document's features (and final hidden state,
    for a teacher) at its offset."""
    rows.zero_()  # padding holds zeros
    if final_rows is not None:
        final_rows.zero_()
    start_of = {(r, d): s for r in range(first, last) for d, s in zip(plan.rows[r], plan.starts[r])}
    for batch in forward_batches(plan, first, last, forward_tokens):
        lengths = [len(plan.docs[d].input_ids) for _, d in batch]
        ids = np.zeros(batch_shape(plan, batch), np.int64)
        for b, (_, d) in enumerate(batch):
            ids[b, : lengths[b]] = plan.docs[d].input_ids
        with forward_fits(ids.shape, forward_tokens, rows.device):
            features, final = target.forward(_to_device(ids, rows.device))
        for b, ((r, d), n) in enumerate(zip(batch, lengths)):
            start = start_of[r, d]
            rows[r - first, start : start + n] = features[b, :n]
            if final_rows is not None:
                final_rows[r - first, start : start + n] = final[b, :n]


def probe_largest_forward(plan: PartPlan, groups: list[tuple[int, int]], forward_tokens: int, target) -> None:
    """Run the forward of the part's largest batch (most padded tokens, then the longest) on random tokens before
    any row, when a later group holds it: a document too long for the GPU is then refused in the run's first
    seconds, not when its group comes up hours in. The first group's own forwards come first anyway."""
    if not groups:
        return
    size = lambda shape: (shape[0] * shape[1], shape[1])  # noqa: E731
    shapes = [[batch_shape(plan, b) for b in forward_batches(plan, *group, forward_tokens)] for group in groups]
    largest = max((shape for group in shapes for shape in group), key=size)
    if size(largest) <= max(map(size, shapes[0]), default=(0, 0)):
        return
    ids = torch.randint(target.info.vocab_size, largest, generator=torch.Generator().manual_seed(0))
    with forward_fits(largest, forward_tokens, target.device):
        target.forward(_to_device(ids.numpy(), target.device))


@contextlib.contextmanager
def forward_fits(shape: tuple[int, int], forward_tokens: int, device: torch.device):
    """The target's forward of a [documents, padded length] batch, its GPU out-of-memory error turned into what
    to change."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        batch, length = shape
        kept = "the rows committed so far are kept and the rerun resumes after them"
        if batch > 1:
            what = f"{batch} documents of up to {length} tokens"
            fix = (
                f"rerun with a lower --forward-tokens (now {forward_tokens}) so that fewer documents share a forward "
                f"({kept})"
            )
        else:
            what = f"one document of {length} tokens"
            fix = (
                "one document this long does not fit a forward of this target on this GPU: split the target over "
                f"GPUs with --tensor-parallel under torchrun ({kept}), or harvest into a new --out with a --max-length "
                f"below {length} and --overflow split (the pieces lose their earlier context)"
            )
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        on = f"{device} ({total / 1e9:.0f} GB)" if total else str(device)
        raise DflashError(f"the target's forward of {what} ran out of memory on {on}: {fix}") from exc


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":  # a pageable source would make the copy wait for the GPU to drain
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _copy_to_host(stored: dict, host: dict, n: int, copy_stream) -> torch.cuda.Event | None:
    """Start the device-to-host copy of the first n encoded rows on the side stream; returns its completion event."""
    if copy_stream is None:
        for name, source in stored.items():
            host[name][:n].copy_(source[:n])
        return None
    copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
    with torch.cuda.stream(copy_stream):
        for name, source in stored.items():
            host[name][:n].copy_(source[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
    return done


def _submit(writer: RowWriter, group: RowGroup) -> float:
    """Queue a group for writing once its host copy is complete; returns the seconds spent waiting for that."""
    t0 = time.perf_counter()
    if group.ready is not None:
        group.ready.synchronize()
    waited = time.perf_counter() - t0
    writer.jobs.put(group)
    return waited
