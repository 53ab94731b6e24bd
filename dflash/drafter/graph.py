"""The one place where steps are compiled and captured.

A step is a Python function of no arguments that reads static input buffers and writes static outputs (the
weights, the optimizer state, metric accumulators). `GraphedStep` warms it up with gradients on, on a side
stream of the main thread, before any data flows, then captures the whole of it in one `torch.cuda.CUDAGraph`
and replays that graph for every later step. Between replays only the contents of the static buffers change,
so a step can neither change shape nor allocate: memory is flat by construction. On the CPU the same
function runs directly (compiled or not). `compile_decoding` is the eval's counterpart: a speculative round's
drafting, compiled with dynamic sizes and no capture because its context grows every round; `CapturedCall` replays
that drafting from CUDA graphs, one per context bucket (`dflash eval --drafting-cuda-graph`).

After warmup a recompile would mean that something in a step differs from the warmed-up steps (a shape, a
dtype, a Python value baked into the graph). `no_recompiles` turns it into a `DflashError` naming the guard
that failed, instead of a stall of many seconds every time the input changes.
"""

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from dflash.errors import DflashError

logger = logging.getLogger(__name__)


def compile_fn(fn: Callable, enabled: bool, options: dict | None = None) -> Callable:
    """torch.compile with whole-graph capture and static shapes: a graph break or a dynamic shape is a bug here.
    options: inductor options for this function only (see blocks.MASK_COMPILE_OPTIONS)."""
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options) if enabled else fn


DECODING_RECOMPILE_LIMIT = 64  # compile_decoding's: the entries of one code object across a whole eval


def compile_decoding(fn: Callable) -> Callable:
    """torch.compile for the device work of a speculative decoding round (`dflash eval`), whose context grows by
    every accepted token: sizes are symbolic (dynamic=True), so one graph serves every context length where static
    shapes would recompile at each, and nothing is captured in a CUDA graph (that would be one graph per length:
    CapturedCall pads the lengths to buckets for that).
    Fusing the eager forward's hundreds of small kernels into a few is the gain: a round of one prompt is bound by
    the host's launches. Whole-graph capture: a graph break is a bug here.

    Each proposer compiles its own bound methods, which dynamo counts as recompiles of one code object (one per
    drafter compared, temperature and attention mask kind): the limit is raised to DECODING_RECOMPILE_LIMIT so that
    an eval of many drafters does not hit dynamo's default of 8, which fullgraph=True turns into a failure."""
    _raise_recompile_limit()
    return torch.compile(fn, fullgraph=True, dynamic=True)


def _raise_recompile_limit() -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, DECODING_RECOMPILE_LIMIT)


# The types torch's pytree knew when this run's compiles began (see no_recompiles).
_pytree_types_at_reset: frozenset[type] = frozenset()


def forget_compiled_code() -> None:
    """Drop what dynamo compiled earlier in this process, before a run compiles its own step. Each new drafter's
    forward is a recompile of the same code object to dynamo: a second run in one process (tests, benchmarks, a
    script training several drafters) would count the earlier runs' entries against dynamo's recompile limit and
    fail its whole-graph compile (the H100, 2026-12-05)."""
    global _pytree_types_at_reset
    torch._dynamo.reset()
    _pytree_types_at_reset = frozenset(pytree.SUPPORTED_NODES)


def pytree_types_registered_since_reset() -> list[str]:
    """Types registered with torch's pytree since forget_compiled_code, by module and name. A traced region that
    flattens a pytree (a checkpointed layer) guards on that registry, so a package registering a type during a
    compile invalidates the graphs compiled before it: a recompile that no input explains."""
    new = set(pytree.SUPPORTED_NODES) - _pytree_types_at_reset if _pytree_types_at_reset else set()
    return sorted(f"{t.__module__}.{t.__qualname__}" for t in new)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled so far in this process; its growth after warmup counts recompiles."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def no_recompiles():
    """Make any recompile inside the block a DflashError that names the failed guard."""
    config = torch._dynamo.config
    previous = config.error_on_recompile
    config.error_on_recompile = True
    try:
        yield
    except torch._dynamo.exc.RecompileError as exc:
        registered = pytree_types_registered_since_reset()
        cause = (
            f"; torch's pytree registry gained {', '.join(registered)} since the compiles began: import "
            "the module(s) that register them before training, so that every graph is traced after"
            if registered
            else ""
        )
        raise DflashError(
            "a compiled step was recompiled after warmup, so some input changed between steps; "
            f"dynamo says: {' '.join(str(exc).split())}{cause}"
        ) from exc
    finally:
        config.error_on_recompile = previous


@torch.library.custom_op("dflash::stored", mutates_args=())
def stored(x: torch.Tensor) -> torch.Tensor:
    """x, written to memory once. Compiled, a cheap expression is inlined into each consumer; a per-row value that a
    [rows, vocabulary] pass reads is then recomputed for every one of its elements (the loads and the math of all
    its inputs, per logit: docs/benchmarks.md, "DSpark's loss kernels"). An opaque op is a value inductor must
    store."""
    return x.clone()


stored.register_fake(torch.empty_like)
stored.register_autograd(lambda ctx, grad: grad)


class StaticBuffers(dict):
    """Named tensors whose storage every step reads; data is copied in, never rebound, after checks."""

    def load(self, name: str, value: torch.Tensor):
        buffer = self[name]
        if value.shape != buffer.shape or value.dtype != buffer.dtype:
            raise DflashError(
                f"static buffer {name!r} is {tuple(buffer.shape)} {buffer.dtype}, "
                f"got {tuple(value.shape)} {value.dtype}"
            )
        buffer.copy_(value)


def settle(*steps: "GraphedStep", rounds: int = 2, on_any_rank: Callable[[bool], bool] = bool) -> int:
    """After each step's own warmup, call every step once more until a round compiles nothing (at most `rounds`).
    One step's compile can leave the guards of a step traced before it stale: a package that registers a pytree
    type while the validation step compiles voids the train step's checkpointed layers (the suspected cause of
    the H100's FLASH pointwise recompile, 2026-12-05). The recompile then happens here, in warmup, instead of in
    the first call outside a CUDA graph (--no-cuda-graph, the bench's ungraphed steps). One that recurs every
    round is left to no_recompiles, which names its guard. Returns the graphs these rounds compiled (logged).
    on_any_rank(flag): whether any rank's flag is set, so that all ranks run the same rounds (a step holding a
    collective would otherwise wait forever on a rank that stopped)."""
    start = compiled_graphs()
    for _ in range(rounds):
        before = compiled_graphs()
        for step in steps:
            step.warmup(1)
        if not on_any_rank(compiled_graphs() != before):
            break
    recompiled = compiled_graphs() - start
    if recompiled:
        registered = pytree_types_registered_since_reset()
        logger.info(
            "warmup: %d graph(s) compiled again once every step had compiled (a later compile voided an earlier "
            "one's guards%s)",
            recompiled,
            f"; torch's pytree registry gained {', '.join(registered)}" if registered else "",
        )
    return recompiled


class GraphedStep:
    """Runs `step()`: warmed up, then replayed from a CUDA graph (CUDA) or called directly (CPU / no graph).

    `hint` names the options that shrink the step; it goes into the error raised on out-of-memory during
    warmup or capture. `pool` lets several steps (train and validation) share one graph memory pool, which is
    safe because they never run at the same time.
    """

    def __init__(self, step: Callable[[], None], *, device: torch.device, cuda_graph: bool, hint: str, pool=None):
        self.step, self.device, self.hint = step, device, hint
        self.use_graph = cuda_graph and device.type == "cuda"
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def warmup(self, iterations: int = 2):
        """Run the step eagerly `iterations` times: compiles everything and creates lazy state (optimizer)."""
        with self._oom("warmup"):
            if self.device.type != "cuda":
                for _ in range(iterations):
                    self.step()
                return
            # A side stream, as the CUDA-graph docs require: warmup must not leave work that a capture on the
            # same stream would pick up, and autograd's stream bookkeeping must already point at a side stream.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(iterations):
                    self.step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)

    def capture(self):
        if not self.use_graph:
            return
        self.graph = torch.cuda.CUDAGraph()
        with self._oom("capture"):
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.step()
        torch.cuda.synchronize(self.device)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    @contextlib.contextmanager
    def _oom(self, phase: str):
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise DflashError(f"out of memory during {phase} of the step: lower {self.hint}") from exc


class CapturedCall:
    """fn(*args) for the eval's drafting (the drafter's forward over a padded context, a method's choice from the
    block's hidden states): compiled, then on CUDA captured once per call signature and replayed. Compiled alone, a
    round of one prompt still waits on the host's launch of every kernel; replayed, a round took 12-28 % less on an
    H100 and DFlash 2's extra kernels no longer lengthen it (docs/benchmarks.md, "Every temperature").

    A signature is the shapes and dtypes of the tensor arguments and the values of the others (None, a temperature,
    a flag), which are baked into its graph. The tensors are copied into that signature's static buffers, the graph
    replays, and the outputs are returned as copies: the next replay overwrites the graph's own. More than
    `max_signatures` signatures means that the caller's shapes are not fixed: a DflashError, not a capture per call.
    `dynamic`: compile once with symbolic sizes (compile_decoding) for a caller whose shapes come in a few buckets,
    each then only captured, instead of compiled again at static shapes. On the CPU the same buffers feed the
    compiled function directly."""

    def __init__(self, fn: Callable, device: torch.device, max_signatures: int = 16, dynamic: bool = False):
        _raise_recompile_limit()
        self.name = getattr(fn, "__qualname__", type(fn).__qualname__)
        self.fn = compile_decoding(fn) if dynamic else compile_fn(fn, enabled=True)
        self.device, self.max_signatures = device, max_signatures
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.captured: dict[tuple, tuple[StaticBuffers, GraphedStep, dict]] = {}

    def __call__(self, *args):
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        if key not in self.captured:
            self.captured[key] = self._capture(key, args)
        buffers, step, result = self.captured[key]
        for name, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                buffers.load(str(name), value)
        step()
        return pytree.tree_map_only(torch.Tensor, torch.clone, result["out"])

    def _capture(self, key: tuple, args: tuple) -> tuple[StaticBuffers, GraphedStep, dict]:
        if len(self.captured) >= self.max_signatures:
            raise DflashError(
                f"{self.name} was called with more than {self.max_signatures} signatures (shapes, dtypes, values), "
                f"the latest {key}: a fixed-shape step's inputs must keep their shapes from call to call"
            )
        buffers = StaticBuffers({str(i): a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
        inputs = [buffers.get(str(i), a) for i, a in enumerate(args)]
        result = {}

        def step():
            result["out"] = self.fn(*inputs)

        graphed = GraphedStep(
            step, device=self.device, cuda_graph=True, hint="the drafters one eval compares", pool=self.pool
        )
        graphed.warmup()
        graphed.capture()
        return buffers, graphed, result
