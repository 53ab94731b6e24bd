"""Tensor-parallel groups: under torchrun, `--tensor-parallel T` splits the N processes into N/T groups of T
consecutive ranks, each holding one copy of the target split by transformers' own tensor-parallel plan (with
`--expert-parallel`, an MoE target's experts by its expert-parallel plan: dflash.target.split_options).

Each group is its own torch.distributed world (one PrefixStore per group on torchrun's store): transformers
builds its mesh over the whole default world (a `device_mesh` passed with a tp plan is replaced by one over
every process), so a group is split over by making it the world. Groups run no collective together: they share
the data as single-process ranks do (data rank = the group's index, data world = the number of groups).

In a group only rank 0, the leader, runs the command's logic, reads the data and writes; the other ranks, the
followers, mirror its collective steps. Before loading the target and before each forward the leader announces
the step on a CPU (gloo) channel, so that announcing never waits for the GPU; a forward's token ids follow on
the group's device backend. A follower runs each step as announced and leaves when the leader says stop (the
harvest). A command whose every process can run the same steps on the split target's replicated outputs (eval,
regenerate) needs no announcing: its followers run the same code as the leader. With several groups such a
command gives each group its share of the work, and the first process (global rank 0) collects the other groups'
results through torchrun's store and alone writes the output (`GroupShares`).
"""

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.errors import DflashError
from dflash.target_files import checkpoint_file, load_config, weight_files

logger = logging.getLogger("dflash")

# Loading a large checkpoint, or a leader's calibration and free-space checks, can keep followers waiting long.
GROUP_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class Layout:
    """Where this process sits among the torchrun processes."""

    size: int  # processes per group (--tensor-parallel)
    group: int  # the group's index: the data rank, the store part it writes
    groups: int  # the data world
    group_rank: int  # 0: the leader

    @property
    def leader(self) -> bool:
        return self.group_rank == 0

    def describe(self) -> str:
        first = self.group * self.size
        role = "its leader (it writes)" if self.leader else "a follower (it writes nothing)"
        return (
            f"parallel layout: {self.groups * self.size} processes = {self.groups} tensor-parallel group(s) of "
            f"{self.size}; this process is rank {self.group_rank} of group {self.group} (global ranks {first}.."
            f"{first + self.size - 1}), {role}"
        )


def group_layout(tensor_parallel: int) -> Layout:
    """This process's layout from torchrun's RANK and WORLD_SIZE."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if tensor_parallel < 1 or world % tensor_parallel:
        raise DflashError(
            f"--tensor-parallel {tensor_parallel} does not divide the {world} processes: launch a multiple of it "
            f"(torchrun --nproc-per-node {max(1, tensor_parallel)} or more), or pick a divisor of {world}"
        )
    return Layout(tensor_parallel, rank // tensor_parallel, world // tensor_parallel, rank % tensor_parallel)


def is_first_process() -> bool:
    """Whether this process writes the output of a command whose launch shares its work (eval, regenerate): the first
    one does (global rank 0; a run outside torchrun is it)."""
    return int(os.environ.get("RANK", 0)) == 0


# Plan entries whose output the forward reshapes into heads (transformers splits any other width unevenly without
# harm): each process must hold whole ones, or every process of the group fails in its first forward.
HEAD_SPLITS = {"q_proj": ("attention heads", "num_attention_heads"), "k_proj": ("KV heads", "num_key_value_heads")}


def check_split(model: str, tensor_parallel: int, expert_parallel: bool = False) -> None:
    """Refuse, before loading, a split of `model` over `tensor_parallel` processes that it cannot take: the harvest,
    eval and regenerate before their groups start, and plan before it prices one."""
    if tensor_parallel > 1:
        check_tp_plan(model)
    if expert_parallel:
        check_ep_plan(model, tensor_parallel)
    if tensor_parallel > 1:
        check_heads(model, tensor_parallel)


def check_heads(model: str, tensor_parallel: int) -> None:
    """Refuse a split whose processes would hold parts of a head (see HEAD_SPLITS)."""
    text = load_config(model).get_text_config()
    split = {entry.rsplit(".", 1)[-1] for entry, style in text.base_model_tp_plan.items() if style == "colwise"}
    heads = {
        what: getattr(text, field, None) or text.num_attention_heads
        for projection, (what, field) in HEAD_SPLITS.items()
        if projection in split
    }
    bad = [f"{count} {what}" for what, count in heads.items() if count % tensor_parallel]
    if bad:
        raise DflashError(
            f"--tensor-parallel {tensor_parallel} does not divide the target's {' and '.join(bad)} ({model}): each "
            f"process of a group must hold whole heads; pick a --tensor-parallel that divides "
            f"{math.gcd(*heads.values())}"
        )


def check_tp_plan(model: str) -> None:
    """Refuse, before loading, a target that transformers has no tensor-parallel plan for."""
    text = load_config(model).get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise DflashError(
            f"transformers has no tensor-parallel plan for the model type {text.model_type!r} of {model}: it cannot "
            "be split over GPUs; run it whole (no --tensor-parallel) on a device that holds it"
        )


def check_ep_plan(model: str, tensor_parallel: int) -> None:
    """Refuse, before loading, --expert-parallel for a target that transformers has no expert-parallel plan for, or
    whose experts the group's processes do not divide."""
    text = load_config(model).get_text_config()
    if not getattr(text, "base_model_ep_plan", None):
        raise DflashError(
            f"transformers has no expert-parallel plan for the model type {text.model_type!r} of {model} (not an "
            "MoE, or one it does not split by expert): drop --expert-parallel, --tensor-parallel alone splits it"
        )
    experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    if experts and experts % tensor_parallel:
        raise DflashError(
            f"--expert-parallel gives each of the {tensor_parallel} processes of a group a whole share of the "
            f"{experts} experts of {model}: pick a --tensor-parallel that divides {experts}, or drop --expert-parallel"
        )


def checkpoint_bytes(model: str) -> int:
    """Bytes of the checkpoint's weight files: what the target takes in memory, at the checkpoint's dtype."""
    return sum(Path(checkpoint_file(model, name)).stat().st_size for name in weight_files(model))


OTHERS_HOLD = 0.1  # of a GPU's memory held before this process loads anything: more than a CUDA context's share


def check_weights_fit(model: str, tensor_parallel: int, device: torch.device) -> None:
    """Refuse, before loading, a target whose weights exceed the free memory of its group's GPUs."""
    if device.type != "cuda":
        return  # host memory is the operating system's to manage
    weights = checkpoint_bytes(model)
    free_to_driver, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    # Blocks this process freed stay reserved by torch's allocator, not free to the driver, and serve its next load
    # (an eval run after another in one process).
    free = free_to_driver + reserved - torch.cuda.memory_allocated(device)
    if weights <= tensor_parallel * free:
        return
    ways = []
    held = total - free_to_driver - reserved  # by other processes (and CUDA contexts)
    if held > OTHERS_HOLD * total:  # a full GPU is not the cause, and more GPUs may not be the fix
        ways.append(f"other processes hold {held / 1e9:.1f} GB of the GPU (nvidia-smi lists them): end them")
    if free > 0:
        ways.append(
            f"split it over more GPUs with --tensor-parallel {-(-weights // free)} or more (torchrun "
            "--nproc-per-node a multiple of it)"
        )
    raise DflashError(
        f"the target's weights ({weights / 1e9:.1f} GB) do not fit in the free memory of {tensor_parallel} GPU(s) "
        f"({tensor_parallel} x {free / 1e9:.1f} GB free of {total / 1e9:.1f} GB): {', or '.join(ways)}"
    )


class Group:
    """This process's tensor-parallel group, set up as its torch.distributed world."""

    def __init__(self, layout: Layout, device: torch.device):
        self.layout = layout
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds the group's communicator to the current device
        # The launch's store (torchrun's): the groups' worlds are set up on it, and an eval's groups hand their
        # rows to the first process through it (dflash.evaluate.shares). One rendezvous per process: rank 0's would
        # start a second server on the same port.
        self.store = next(dist.rendezvous("env://"))[0]
        store = dist.PrefixStore(f"dflash-tp-group-{layout.group}/", self.store)
        dist.init_process_group(
            backend,
            store=store,
            rank=layout.group_rank,
            world_size=layout.size,
            timeout=GROUP_TIMEOUT,
            device_id=device if backend == "nccl" else None,
        )
        self.control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend != "gloo" else None
        self.device, self.broken = device, False

    def announce(self, *step) -> None:
        """The leader tells the followers the next step (a tuple of picklable values)."""
        dist.broadcast_object_list([step], src=0, group=self.control)

    def next_step(self) -> tuple:
        received = [None]
        dist.broadcast_object_list(received, src=0, group=self.control)
        return received[0]

    def share_ids(self, input_ids: torch.Tensor) -> None:
        """The leader's side of a forward: its shape on the CPU channel, then the ids on the device backend."""
        self.announce("forward", tuple(input_ids.shape), str(input_ids.dtype).removeprefix("torch."))
        dist.broadcast(input_ids.to(self.device), src=0)

    def follow(self, load_target) -> None:
        """A follower's loop: load the target and run forwards as announced, until the leader stops."""
        target = None
        while (step := self.next_step())[0] != "stop":
            if step[0] == "load":
                target = load_target(*step[1:])
            else:
                ids = torch.empty(step[1], dtype=getattr(torch, step[2]), device=self.device)
                dist.broadcast(ids, src=0)
                target.forward(ids)

    @contextlib.contextmanager
    def guarded(self):
        """A collective step that fails because a process of the group is gone (killed, out of memory) raises a
        DflashError saying so; the group is then broken, and no step is announced any more."""
        try:
            yield
        except RuntimeError as exc:
            if not (isinstance(exc, dist.DistError) or "gloo" in str(exc)):
                raise
            self.broken = True
            raise DflashError(
                f"a process of tensor-parallel group {self.layout.group} stopped ({str(exc).splitlines()[0]}); the "
                "rows committed so far are kept: rerun the same launch to resume after them"
            ) from exc

    def release(self) -> None:
        """The leader ends its followers' loop (also after an error: they would wait forever)."""
        if self.layout.leader and not self.broken:
            self.announce("stop")

    def close(self) -> None:
        dist.destroy_process_group()


def open_group(
    model: str, tensor_parallel: int, device: torch.device, shares_work: bool = False, expert_parallel: bool = False
) -> Group | None:
    """The refusals before `model` loads, then this process's group; None without one. `shares_work` (eval,
    regenerate): under torchrun without a split each process is a group of one, so that the launch shares the
    prompts through `GroupShares` as split groups do (the harvest shares its rows by rank instead).
    `expert_parallel` (with `tensor_parallel` above 1, which the configs check): the target's experts are split by
    transformers' expert-parallel plan (dflash.target.split_options)."""
    check_weights_fit(model, tensor_parallel, device)
    if tensor_parallel == 1 and not (shares_work and int(os.environ.get("WORLD_SIZE", 1)) > 1):
        return None
    check_split(model, tensor_parallel, expert_parallel)
    layout = group_layout(tensor_parallel)
    logger.info(layout.describe())
    return Group(layout, device)


class GroupShares:
    """Several groups of one launch, each on its share of a command's work (eval's prompts, regenerate's batches):
    the leader of each group but the first posts each result (a JSON object) and then its end, and the first
    process (global rank 0, which alone writes the output) collects them; before that it can tell every process a
    value (regenerate's resume point).

    Through torchrun's store, not through share files beside the output: the store is already there (the groups'
    worlds are set up on it) and reaches every node of the launch; nothing is left behind to clean up or to go
    stale after a success, a failure or a different layout next time; a group's failure reaches the first process
    at once, as its message, instead of as a file it would wait on. The keys carry torchrun's restart count, so that
    a restarted launch (the agent's store outlives its workers) reads none of an earlier attempt's."""

    def __init__(self, group: Group, command: str):
        layout = group.layout
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"dflash-{command}-shares-{restart}/", group.store)
        self.group, self.groups, self.timeout = layout.group, layout.groups, GROUP_TIMEOUT
        self.posts = layout.leader and layout.group > 0
        self.collects = layout.leader and layout.group == 0
        self.posted = 0
        self.taken = {g: 0 for g in range(1, layout.groups)}  # the first process: results taken of each group
        self.ended: set[int] = set()
        self.failure: tuple[int, str] | None = None

    def tell(self, value) -> None:
        """The first process: a JSON value for every other process (`told`)."""
        self.store.set("told", json.dumps(value))

    def told(self):
        """Any other process: the value the first one tells (waiting for it)."""
        return json.loads(self.store.get("told"))

    def post(self, result: dict) -> None:
        """A result this group made (a JSON object); the leaders of other groups than the first only."""
        if self.posts:
            self.store.set(f"{self.group}/row{self.posted}", json.dumps(result))
            self.posted += 1
            self.store.add(f"{self.group}/rows", 1)

    def end(self, error: str | None = None) -> None:
        """This group's share is done (or failed with `error`): posted after its last result."""
        if self.posts:
            self.store.set(f"{self.group}/end", json.dumps({"rows": self.posted, "error": error}))

    def collect(self) -> list[dict]:
        """The first process takes the results posted since its last look. A group that failed is kept for
        `check_failure`, once its results before the failure are taken."""
        new = []
        for g in sorted(set(self.taken) - self.ended):
            ended = self.store.check([f"{g}/end"])  # before the count: an ended group's results are all counted
            count = self.store.add(f"{g}/rows", 0)
            while self.taken[g] < count:
                key = f"{g}/row{self.taken[g]}"
                new.append(json.loads(self.store.get(key)))
                self.store.delete_key(key)  # taken: the store (torchrun's agent) need not hold every answer
                self.taken[g] += 1
            if ended:
                self.ended.add(g)
                error = json.loads(self.store.get(f"{g}/end"))["error"]
                if error and self.failure is None:
                    self.failure = (g, error)
        return new

    def check_failure(self) -> None:
        """Raise the first failure of another group that `collect` saw."""
        if self.failure is not None:
            group, error = self.failure
            raise DflashError(
                f"tensor-parallel group {group} stopped ({error}); the output holds every group's work finished "
                "before it: fix that and rerun the launch to go on after it (eval: with --resume)"
            )

    def wait(self, on_new) -> None:
        """The first process, its own share done: collects until every group has ended, calling `on_new(results)`
        with new results. A group that posts nothing for the group timeout is taken for gone."""
        last = time.monotonic()
        while True:
            if new := self.collect():
                last = time.monotonic()
                on_new(new)
            self.check_failure()
            if len(self.ended) == len(self.taken):
                return
            if time.monotonic() - last > self.timeout.total_seconds():
                missing = sorted(set(self.taken) - self.ended)
                raise DflashError(
                    f"tensor-parallel group(s) {missing} posted nothing for {self.timeout}: a process of theirs is "
                    "gone or stuck; the output holds the work finished so far: rerun the launch to go on after it "
                    "(eval: with --resume)"
                )
            time.sleep(0.2)


@contextlib.contextmanager
def shared_work(group: Group | None, command: str):
    """The block of a command whose launch shares its work (eval, regenerate), given this process's group: yields
    its GroupShares with several groups (None otherwise). A failure in the block is told to the first process, which
    waits on this group, before it propagates; the group is closed either way, and a success ends the share."""
    shares = GroupShares(group, command) if group is not None and group.layout.groups > 1 else None
    try:
        yield shares
    except BaseException as exc:
        if shares is not None:  # the first process may be gone already: telling it must not hide `exc`
            with contextlib.suppress(Exception):
                shares.end(error=(str(exc).strip().splitlines() or [type(exc).__name__])[0][:500])
        raise
    finally:
        if group is not None:
            group.close()
    if shares is not None:
        shares.end()
