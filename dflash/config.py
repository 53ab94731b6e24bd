"""The configs of every command, each the single source of its options' defaults and help.

They live here, free of torch, so that the command line can be built without importing torch.

A field declared with `option(default, "help")` carries its help text in its metadata; `cli/options.py` turns
every such field into a click option whose own default is None, so that a value the user did not give is
filled in by the dataclass, never by a second copy of the default.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MISSING = dataclasses.MISSING


def option(default: Any = MISSING, help: str = "", *, factory=None, **cli) -> Any:
    """A dataclass field with CLI metadata.

    `cli` keys, all optional:
      flag: the option's name when it is not the field's (e.g. "--shards" for the field `store`)
      choices: allowed values
      default_doc: how to describe a default of None (what the code resolves it to)
      path: True for a filesystem path (click.Path)
      hidden: True to keep the field out of the command line
      multiple: True for a repeatable option whose values make a list of strings
      required: True when the command line must give the option although the field has a default
    """
    metadata = {"help": help, **cli}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def given(cls, values: dict) -> Any:
    """`cls(**values)` without the values left at None (not given): the dataclass defaults fill those in."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names and v is not None})


# transformers' experts implementations of an MoE target (`from_pretrained(experts_implementation=...)`; this module
# stays torch-free, a test keeps the list equal to transformers'). deepgemm and sonicmoe need their own kernels.
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe")
EXPERTS_HELP = (
    "An MoE target's experts implementation (transformers'); auto: grouped_mm where torch's grouped matmul runs "
    "on the device (CUDA sm80+, the CPU with torch >= 2.9), else eager. Named in the log's `kernels:` line."
)


def experts_option():
    return option("auto", EXPERTS_HELP, choices=["auto", *EXPERTS_IMPLEMENTATIONS])


def expert_parallel_option():
    return option(
        False,
        "With --tensor-parallel T > 1 and an MoE target: split the experts by transformers' expert-parallel plan "
        "(each process holds 1/T of the experts whole, an all-reduce sums their outputs) instead of slicing every "
        "expert by its tensor-parallel plan; the rest stays tensor-parallel (docs/harvest-parallel.md).",
    )


def check_expert_parallel(cfg) -> None:
    """--expert-parallel splits the experts over a tensor-parallel group: refuse it without one."""
    from dflash.errors import DflashError

    if cfg.expert_parallel and cfg.tensor_parallel < 2:
        raise DflashError(
            "--expert-parallel splits an MoE target's experts over a tensor-parallel group: give --tensor-parallel T "
            "(T > 1, under torchrun) with it, or drop --expert-parallel"
        )


@dataclass
class HarvestConfig:
    model: str = option(help="Target checkpoint: a local transformers folder (or a hub name).")
    data: list[str] = option(
        help="Data source, repeatable: a JSONL (.gz, .zst) or Parquet file or a folder of them, as PATH or PATH:WEIGHT "
        '(take round(WEIGHT x its records)); records {"messages": [...]}, {"conversations": [...]} (ShareGPT), '
        '{"prompt": ..., "completion": ...} or {"text": ...} (docs/data.md).',
        multiple=True,
    )
    out: str = option(help="Store folder to create, or to resume when it holds this harvest.", path=True)
    dedup: bool = option(True, "Keep one copy of identical records, within and across the sources.")
    limit: int | None = option(None, "Keep only the first N records of the mixture (to try a recipe on a slice).")
    data_seed: int = option(0, "Seed of the mixture's weighted sampling and order.")
    layers: list[int] | None = option(
        None, "Comma-separated target layers to tap.", default_doc="the DFlash rule, 5 layers from 1 to L-3"
    )
    token_budget: int = option(12288, "Tokens per stored row; documents are packed whole into rows.")
    max_length: int | None = option(
        None, "Documents longer than this are truncated or split.", default_doc="the token budget"
    )
    overflow: str = option("truncate", "What to do with documents over --max-length.", choices=["truncate", "split"])
    forward_tokens: int = option(32768, "Padded tokens per forward batch (GPU memory vs. speed).")
    workers: int = option(4, "Tokenizer processes.")
    rank: int | None = option(None, "This process's rank.", default_doc="$RANK or 0")
    world_size: int | None = option(None, "Number of harvest processes.", default_doc="$WORLD_SIZE or 1")
    device: str | None = option(None, "Torch device.", default_doc="cuda:$LOCAL_RANK when CUDA is available, else cpu")
    tensor_parallel: int = option(
        1,
        "Under torchrun, split the target over groups of this many processes (transformers' tensor-parallel plan); "
        "each group harvests one part of the store, as one process does without it.",
    )
    expert_parallel: bool = expert_parallel_option()
    dtype: str = option(
        "bfloat16", "Target compute dtype (the store always holds bf16).", choices=["bfloat16", "float16", "float32"]
    )
    allow_slow_kernels: bool = option(
        False, "Run a hybrid target on PyTorch reference kernels on GPU instead of refusing."
    )
    experts: str = experts_option()
    # the feature encoding (docs/shard-format.md, "Feature encodings")
    precision: str = option(
        "bf16", "Stored feature precision: bf16 (lossless) or fp8 (e4m3, power-of-two scales).", choices=["bf16", "fp8"]
    )
    subspace: str = option(
        "none",
        "Store the features projected onto their top-K directions: K, a fraction of the feature width (1/4), or none.",
    )
    scale_groups: int | None = option(
        None,
        "fp8 scales per token (equal slices of the stored width).",
        default_doc="one per tapped layer; 1 with --subspace",
    )
    calibration_tokens: int = option(
        262144, "Tokens of the data (a seeded sample) whose features fix the --subspace projection."
    )
    projection_from: str | None = option(
        None,
        "Use the projection of this subspace store instead of calibrating (a held-out store must share its training store's).",
        path=True,
    )
    teacher: str = option(
        "none",
        "Also store the target's next-token distribution at every position (for DSpark-style training): topk:K (the "
        "top-K probabilities, their ids and the tail mass), hidden (the final-normed last hidden state, bf16), or none.",
    )
    self_check: int = option(
        4,
        "Stored documents re-run alone through the target at the end and compared with the store; the result goes "
        "into the manifest (0: skip; `dflash inspect --reforward N` runs it later).",
    )
    repair: bool = option(
        False, "Re-harvest the rows of this rank's part whose chunks are damaged (what `inspect --verify` lists)."
    )

    def __post_init__(self):
        # One source may be given as a plain string (Python callers, older scripts).
        self.data = [str(self.data)] if isinstance(self.data, (str, Path)) else [str(spec) for spec in self.data]


EXPORT_DTYPES = ["bfloat16", "float32"]
TARGET_EMBEDDINGS_HELP = (
    "Write the target's embedding and LM head into the export's model.safetensors too (embed_tokens.weight, "
    "lm_head.weight): DeepSpec's evaluator needs them for a DSpark drafter; vLLM, SGLang and z-lab share the "
    "target's, so the default leaves them out (docs/export.md)."
)
# The names of dflash.methods.METHODS and dflash.drafter.loss.POSITION_WEIGHTS (this module stays torch-free; a test
# keeps the lists equal).
DRAFTER_METHODS = ("dflash", "dflash2", "dspark")
POSITION_WEIGHTS = ("decay", "dpace")
# What the train step's backward recomputes instead of keeping: nothing; each drafter layer's element-wise work (its
# layer then keeps the outputs of its matmuls and attention only, dflash.drafter.model.KEPT_BY_POINTWISE); or each
# layer's MLP, which then keeps only its input, where the compiled step otherwise keeps gate, up and their SwiGLU
# product.
RECOMPUTE = ("none", "pointwise", "mlp")
# Where the block tokens' embeddings come from: the frozen table on the device, or the reader threads, which look each
# row's tokens up in a host copy of the table and ship them with the row (the table then stays off the GPU); auto
# picks host on a GPU when those per-row embeddings take less device memory than the table (dflash.drafter.memory).
EMBEDDING = ("auto", "device", "host")


@dataclass
class TrainConfig:
    store: str = option(help="The harvest store to train from.", flag="--shards", path=True)
    out: str = option(help="Run folder: checkpoints, metrics.jsonl, tb/, drafter/.", path=True)
    target: str | None = option(
        None, "Checkpoint to read the embedding / LM head from.", path=True, default_doc="the store's target"
    )
    # drafter
    method: str = option(
        "dflash2",
        "Drafter method: dflash2 (dynamic block convs and a candidate selector: the best measured), dflash (the "
        "paper's drafter) or dspark (Markov and confidence heads; needs a store harvested with --teacher); README, "
        "'Drafter methods'.",
        choices=list(DRAFTER_METHODS),
    )
    draft_layers: int = option(5, "Drafter layers.")
    block_size: int | None = option(
        None,
        "Tokens per block: 1 known + B-1 drafted (dspark: its anchor slot drafts too, B drafts).",
        default_doc="16; 7 for dspark",
    )
    drafter_overrides: dict = option(
        help="Override a drafter config field, KEY=VALUE (repeatable).", factory=dict, flag="--drafter-option"
    )
    # step
    anchors: int | None = option(
        None, "Anchors per row.", default_doc="512 per 3072 tokens of the store's token budget"
    )
    gamma: float | None = option(None, "Loss decay exp(-(k-1)/gamma).", default_doc="7 for B=16, 5 for 10, 4 for 8")
    position_weights: str = option(
        "decay",
        "Loss weight of each block position: decay (exp(-(k-1)/gamma), the paper's) or dpace (from the drafter's own "
        "per-position accuracy, D-PACE).",
        choices=list(POSITION_WEIGHTS),
    )
    selector_weight: float = option(1.0, "dflash2: weight of the candidate selector's CE beside the unary CE.")
    selector_outside: str = option(
        "replace",
        "dflash2: a true token outside the top-K candidates replaces the K-th one in the selector's CE (replace), or "
        "that position leaves the selector's CE (drop).",
        choices=["replace", "drop"],
    )
    teacher_loss: str = option(
        "auto",
        "dflash2: from a store harvested with --teacher, train the unary logits and the selector's K-way "
        "distribution against the target's next-token distribution (0.1 CE + 0.9 L1, as DSpark; auto), or on the "
        "hard labels alone (off).",
        choices=["auto", "off"],
    )
    rows_per_step: int = option(1, "Rows per micro-step on each rank.")
    grad_accum: int = option(1, "Micro-steps per optimizer step.")
    loss_chunk: int | None = option(
        None,
        "Drafted tokens per LM-head chunk in the loss.",
        default_doc="the most that keep a chunk of logits under 2^29 (2048 rows for a 152 K-248 K vocabulary)",
    )
    # optimizer and schedule: the paper's; betas, eps and weight decay are torch's AdamW defaults
    lr: float = option(6e-4, "Peak learning rate.")
    min_lr_ratio: float = option(0.0, "Final learning rate as a fraction of the peak.")
    warmup_ratio: float = option(0.04, "Fraction of the steps with linear warmup.")
    weight_decay: float = option(0.0, "AdamW weight decay (matrices only).")
    betas: tuple[float, float] = option((0.9, 0.999), "AdamW betas.")
    eps: float = option(1e-8, "AdamW epsilon.", hidden=True)
    clip: float = option(1.0, "Gradient norm clip.")
    epochs: int = option(6, "Passes over the training rows.")
    max_steps: int | None = option(None, "Stop after this many optimizer steps (overrides --epochs).")
    seed: int = option(0, "Seed of the weights, the row order and the anchors.")
    # validation
    val_fraction: float = option(0.01, "Fraction of the store's rows held out for validation (not with --val-shards).")
    val_store: str | None = option(
        None,
        "A held-out store of other documents (same target, layers and token budget) to validate on, instead of --val-fraction of the training store's rows.",
        flag="--val-shards",
        path=True,
    )
    val_every: int = option(0, "Validate every N steps (0: only at the end).")
    # run
    log_every: int = option(10, "Steps between metric records.")
    ckpt_every: int = option(1000, "Steps between checkpoints (one is always written at the end).")
    resume: bool = option(False, "Continue from the latest complete checkpoint in --out.")
    export: bool = option(True, "Export the drafter to OUT/drafter at the end.")
    export_dtype: str = option("bfloat16", "Dtype of the exported weights.", choices=EXPORT_DTYPES)
    export_with_target_embeddings: bool = option(False, TARGET_EMBEDDINGS_HELP)
    # execution
    prefetch: int = option(2, "Steps of rows read ahead.")
    reader_workers: int = option(4, "Threads reading rows from the store.")
    device: str | None = option(None, "Torch device.", default_doc="cuda:$LOCAL_RANK when CUDA is available, else cpu")
    compile: bool | None = option(None, "torch.compile the step.", default_doc="on for CUDA, off on the CPU")
    cuda_graph: bool | None = option(
        None,
        "Capture the whole step in a CUDA graph (CUDA only: on the CPU the flag is named as unused).",
        default_doc="on for CUDA",
    )
    attention_kernel_options: dict = option(
        help="A flex_attention kernel option for the drafter's attention, KEY=VALUE (repeatable; torch's "
        "FlexKernelOptions, e.g. bwd_num_warps=8, bwd_BLOCK_M1=32, USE_TMA=true; a fwd_ / bwd_ prefix sets one pass "
        "only; BACKEND=FLASH runs flash-attn-4's kernels, the [flash] extra, 1.3x faster steps on long rows): speed "
        "only, docs/training.md.",
        factory=dict,
        flag="--attention-kernel-option",
    )
    recompute: str = option(
        "none",
        "What the backward recomputes instead of keeping: none; pointwise (each layer keeps the outputs of its "
        "matmuls and attention only and runs its norms, RoPE, SwiGLU product, DFlash 2's convs and the bf16 weight "
        "copies again: no matmul repeated); or mlp (each layer's MLP keeps only its input: about 3 x FFN width x 2 "
        "bytes less per block token and layer, for two more matmuls per layer). Memory for speed; the values are "
        "unchanged.",
        choices=list(RECOMPUTE),
    )
    embedding: str = option(
        "auto",
        "Where the frozen token embedding is looked up: device (the table on the GPU, looked up in the step) or host "
        "(the reader threads look up each row's tokens in a host copy and ship their embeddings with the row, so the "
        "table stays off the GPU: 2.5 GB for a 248 K x 5120 vocabulary, for T x hidden x 2 bytes more per row a "
        "step); auto: host on a GPU when a step's rows hold fewer than half a vocabulary of tokens, else device. "
        "Memory only; the values are the same.",
        choices=list(EMBEDDING),
    )
    mask_tile_size: int | None = option(
        None,
        "Positions per side of the attention BlockMask's tiles (create_block_mask's BLOCK_SIZE): flex_attention "
        "skips tiles with no visible pair; a power of two, divisible by the kernel's tiles. Speed only "
        "(docs/training.md).",
        default_doc="64 at a head dim above 192 (measured faster at 256), else torch's 128 (its kernels' tiles at "
        "head dims 64 and 128 on Hopper and Blackwell are 128 wide)",
    )
    peak_tflops: float = option(
        792.0, "Dense bf16 TFLOP/s of one device, the MFU denominator (the default: the H200's, measured)."
    )
    tensorboard: bool = option(True, "Write TensorBoard scalars to OUT/tb.")
    max_damaged_rows: int = option(
        0,
        "Damaged store rows (failed checksum, missing chunk) to skip with zero loss weight, counted in the metrics; "
        "one more stops the run (0: the first stops it, after a checkpoint). Counted per rank.",
    )
    allow_failed_self_check: bool = option(
        False, "Train on a store whose check against its target failed at harvest (refused otherwise)."
    )
    allow_other_target_weights: bool = option(
        False,
        "Train although --target or the --val-shards store comes from other target weights than the store (its "
        "manifest's weights_sha256; refused otherwise): a deliberate fine-tune of the same config.",
    )
    allow_val_overlap: bool = option(
        False,
        "Validate on a --val-shards store harvested from the training store's data (refused otherwise: its "
        "documents are training documents, so the validation is not held out).",
    )
    ignore_memory_estimate: bool = option(
        False,
        "Train even when a step's estimated peak memory exceeds the memory free on the device (refused otherwise, "
        "before any work; docs/training.md, 'Memory').",
    )

    def __post_init__(self):
        """Option values that are wrong whatever the store: one message for all of them, naming the flags."""
        from dflash.errors import DflashError

        positive = (
            "draft_layers",
            "rows_per_step",
            "grad_accum",
            "loss_chunk",
            "epochs",
            "log_every",
            "ckpt_every",
            "prefetch",
            "reader_workers",
            "max_steps",
            "anchors",
        )
        values = {name: getattr(self, name) for name in positive}
        bad = [
            f"--{k.replace('_', '-')} {v} (must be at least 1)" for k, v in values.items() if v is not None and v < 1
        ]
        if not 0 <= self.val_fraction < 1:
            bad.append(f"--val-fraction {self.val_fraction} (must be in [0, 1))")
        if not 0 <= self.warmup_ratio <= 1:
            bad.append(f"--warmup-ratio {self.warmup_ratio} (must be in [0, 1])")
        for flag, value, allowed in (
            ("--method", self.method, DRAFTER_METHODS),
            ("--position-weights", self.position_weights, POSITION_WEIGHTS),
            ("--selector-outside", self.selector_outside, ("replace", "drop")),
            ("--teacher-loss", self.teacher_loss, ("auto", "off")),
        ):
            if value not in allowed:
                bad.append(f"{flag} {value} ({' or '.join(allowed)})")
        if self.selector_weight < 0:
            bad.append(f"--selector-weight {self.selector_weight} (must be at least 0)")
        if self.lr <= 0 or self.clip <= 0 or (self.gamma is not None and self.gamma <= 0):
            bad.append("--lr, --clip and --gamma must be positive")
        tile = self.mask_tile_size
        if tile is not None and (tile < 16 or tile & (tile - 1)):
            bad.append(f"--mask-tile-size {self.mask_tile_size} (must be a power of two, at least 16)")
        if self.export_dtype not in EXPORT_DTYPES:
            bad.append(f"--export-dtype {self.export_dtype} ({' or '.join(EXPORT_DTYPES)})")
        if bad:
            raise DflashError(f"invalid options: {'; '.join(bad)}")


@dataclass
class ExportConfig:
    run: str = option(help="The training run folder.", hidden=True)  # the command's argument, not an option
    out: str = option(help="Folder to write config.json + model.safetensors to.", path=True)
    step: int | None = option(None, "Checkpoint step to export.", default_doc="the latest complete one")
    dtype: str = option("bfloat16", "Dtype of the exported weights.", choices=EXPORT_DTYPES)
    force: bool = option(False, "Replace an earlier dflash export at --out (any other non-empty folder is refused).")
    with_target_embeddings: bool = option(False, TARGET_EMBEDDINGS_HELP)
    target: str | None = option(
        None,
        "The target checkpoint whose embedding and LM head --with-target-embeddings writes.",
        path=True,
        default_doc="the run's --target, else its store's target",
    )


# ---- generation: regenerate and eval --------------------------------------------------------------------------

GENERATION_DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICE_HELP = "Torch device; auto: cuda:$LOCAL_RANK when CUDA is available, else cpu."
DTYPE_HELP = "Model dtype: auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16, float32."


def _check_generation(cfg, at_least: dict[str, float]) -> None:
    """Every `field: lowest value` of `at_least`, and the dtype name: a DflashError naming the option otherwise."""
    from dflash.errors import DflashError

    for name, lowest in at_least.items():
        value = getattr(cfg, name)
        if value is not None and value < lowest:
            flag = "--" + name.replace("_", "-")
            raise DflashError(f"{flag} must be at least {lowest}, got {value}; give {flag} {lowest} or more")
    if isinstance(cfg.dtype, str) and cfg.dtype not in GENERATION_DTYPES:
        raise DflashError(f"unknown --dtype {cfg.dtype!r}; choose {', '.join(GENERATION_DTYPES)}")


@dataclass
class RegenerateConfig:
    # Not needed with --server; data and out are required all the same (`required` makes click say so).
    model: str | None = option(None, "Target model folder (generate locally).", path=True)
    data: str = option(
        None,
        "Prompts: a JSONL (.gz, .zst) or Parquet file, or a folder of them; chat 'messages' or ShareGPT "
        "'conversations', 'text' or 'prompt' records.",
        path=True,
        required=True,
    )
    out: str = option(None, "Responses JSONL; an existing one is resumed.", path=True, required=True)
    batch_size: int = option(8, "Prompts per generate call (left-padded).")
    max_new_tokens: int = option(
        512, "Longest response, in tokens; a longer one is cut, marked unfinished and kept without its end token."
    )
    temperature: float = option(0.0, "0 = greedy; > 0 samples.")
    top_p: float = option(1.0, "Nucleus sampling (with --temperature > 0), in (0, 1].")
    top_k: int = option(0, "Top-k sampling; 0 = off (overrides the model's default).")
    seed: int = option(0, "Sampling seed.")
    turns: str = option(
        "last",
        "Assistant turns the target writes: last (the answer to the last user turn; earlier assistant turns stay "
        "the data's, as context with no loss in harvest) or all (every assistant turn, in order, each answering "
        "the target's own history).",
        choices=["last", "all"],
    )
    device: str = option("auto", DEVICE_HELP)
    tensor_parallel: int = option(
        1,
        "Under torchrun, split the local target over groups of T processes (transformers' tensor-parallel plan); "
        "--nproc-per-node G*T makes G groups, which take the batches in turn; the first process writes the output, "
        "in prompt order (T = 1 under torchrun: each process a group of one).",
    )
    expert_parallel: bool = expert_parallel_option()
    dtype: str = option("auto", DTYPE_HELP)
    experts: str = experts_option()
    server: str | None = option(None, "OpenAI-compatible server to generate through, e.g. http://localhost:8000.")
    server_model: str | None = option(None, "Model name to request from --server.", default_doc="the one it serves")
    concurrency: int = option(16, "Requests in flight to --server.")
    request_timeout: float = option(600.0, "Seconds to wait for one answer from --server.")
    retries: int = option(5, "Retries of a --server request (5xx, timeout, no connection), with backoff.")

    def __post_init__(self):
        from dflash.errors import DflashError

        at_least = {"batch_size": 1, "max_new_tokens": 1, "temperature": 0, "top_k": 0, "concurrency": 1, "retries": 0}
        _check_generation(self, {**at_least, "tensor_parallel": 1})
        check_expert_parallel(self)
        if not 0 < self.top_p <= 1:
            raise DflashError(f"--top-p must be in (0, 1], got {self.top_p}; give e.g. --top-p 0.95 (1 = off)")
        if self.data is None or self.out is None:
            raise DflashError("give the prompts (--data) and where to write the responses (--out)")
        if self.model is None and self.server is None:
            raise DflashError("give --model (a target folder, to generate locally) or --server URL (a serving engine)")
        if self.model is not None and self.server is not None:
            raise DflashError("give either --model (generate locally) or --server (generate through it), not both")
        if self.server is not None and self.tensor_parallel > 1:
            raise DflashError("--tensor-parallel splits a local target (--model); a --server splits its own")
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise DflashError(f"--server {self.server} is not an http(s) URL; give e.g. http://localhost:8000")
        if self.request_timeout <= 0:
            raise DflashError(f"--request-timeout must be positive, got {self.request_timeout}; give e.g. 600")


@dataclass
class EvalConfig:
    model: str = option(help="Target model folder.", path=True)
    # From Python, `data` may also be the prompt records themselves (any form a prompt file holds).
    data: str = option(
        help="Prompts: a JSONL (.gz, .zst) or Parquet file, or a folder of them; chat 'messages' or ShareGPT "
        "'conversations', 'text' or 'prompt' records (docs/data.md).",
        path=True,
    )
    # From Python, `drafter` may also be one folder.
    drafter: list[str] = option(
        help="Exported drafter folder; repeat it to compare drafters on the same prompts (each against the first, "
        "paired over prompts).",
        factory=list,
        multiple=True,
        default_doc=None,
    )
    untrained: bool = option(False, "Use a randomly initialised drafter shaped from the target (baseline).")
    block_size: int = option(16, "Block size of the --untrained drafter.")
    num_prompts: int | None = option(
        None,
        "Only the first N prompts (conversations with no user turn to answer are skipped, counted).",
        default_doc="all",
    )
    max_new_tokens: int = option(256, "Tokens generated per prompt.")
    temperature: float = option(
        0.0, "0 = greedy (checked against plain greedy decoding); > 0 samples, and so does the plain baseline."
    )
    prompt_lookup: int = option(10, "Prompt-lookup draft length to compare with; 0 = skip.")
    confidence_cut: float | None = option(
        None,
        "DSpark: end a block's drafts where the confidence head's predicted chance that all of them are accepted "
        "falls below this (0 to 1).",
        default_doc="off: every block drafts its full length",
    )
    seed: int = option(0, "Seed for sampling and for the --untrained drafter.")
    device: str = option("auto", DEVICE_HELP)
    tensor_parallel: int = option(
        1,
        "Under torchrun, split the target over groups of T processes (transformers' tensor-parallel plan); "
        "--nproc-per-node G*T makes G groups, group g evaluating prompts g, g+G, ...; the first process writes the "
        "report of all of them (T = 1 under torchrun: each process a group of one).",
    )
    expert_parallel: bool = expert_parallel_option()
    dtype: str = option("auto", DTYPE_HELP)
    experts: str = experts_option()
    compile_drafter: bool | None = option(
        None,
        "torch.compile each drafter's forward and its method's drafting (DFlash 2's walk, DSpark's chain) with a "
        "dynamic context length: the same drafts, a few fused kernels a round instead of hundreds of launches. The "
        "warm-up pays for the compile.",
        default_doc="on for CUDA, off on the CPU",
    )
    drafting_cuda_graph: bool | None = option(
        None,
        "With --compile-drafter on CUDA, replay each round's drafting from CUDA graphs: the drafter's forward over "
        "its context padded to a bucket (a graph per 256 tokens of context, or per eighth of a longer one's power "
        "of two, captured at the bucket's first round) and the method's drafting from the block (DFlash 2's walk, "
        "DSpark's chain): the same drafts without a launch per kernel, a round 12-28 % shorter on an H100 and DFlash "
        "2's as short as DFlash's (docs/benchmarks.md, Every temperature).",
        default_doc="on with --compile-drafter on CUDA",
    )
    json_path: str | None = option(
        None,
        "Also write the full report (per prompt) as JSON here, updated after every prompt.",
        flag="--json",
        path=True,
    )
    resume: bool = option(False, "Go on from the partial report at --json: its prompts are not run again.")
    allow_other_target_weights: bool = option(
        False,
        "Evaluate a drafter whose export names another target than --model (other weights_sha256; refused "
        "otherwise): a deliberate fine-tune of the target it was trained for.",
    )
    warmup: bool = option(
        True,
        "Run the first prompt briefly before timing, to keep allocations and kernel selection out of the timings.",
        hidden=True,
    )
    time_budget: float | None = option(None, "Seconds after which no further prompt is started.", hidden=True)
    min_prompts: int = option(1, "Prompts run whatever the time budget.", hidden=True)

    def __post_init__(self):
        from dflash.errors import DflashError

        at_least = {
            "block_size": 2,
            "num_prompts": 1,
            "max_new_tokens": 1,
            "temperature": 0,
            "prompt_lookup": 0,
            "tensor_parallel": 1,
        }
        _check_generation(self, at_least)
        check_expert_parallel(self)
        self.drafter = [self.drafter] if isinstance(self.drafter, (str, Path)) else list(self.drafter)
        if self.drafter and self.untrained:
            raise DflashError("give either --drafter or --untrained, not both")
        if len(set(map(str, self.drafter))) < len(self.drafter):
            raise DflashError("a --drafter folder is given twice; give each drafter to compare once")
        if self.resume and not self.json_path:
            raise DflashError("--resume goes on from the report at --json: give --json REPORT")
        if self.drafting_cuda_graph and self.compile_drafter is False:
            raise DflashError("--drafting-cuda-graph replays the compiled drafting: drop --no-compile-drafter")
        if self.confidence_cut is not None and not 0 <= self.confidence_cut <= 1:
            raise DflashError(
                f"--confidence-cut {self.confidence_cut} is not a chance between 0 and 1; give e.g. --confidence-cut 0.5"
            )
