"""The target: a small Qwen3.5 hybrid trained from scratch on the train files for a fixed time."""

import contextlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.quality.scale import Scale

logger = logging.getLogger("quality")


def target_config(scale: Scale, tokenizer):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=scale.hidden,
        intermediate_size=scale.intermediate,
        num_hidden_layers=scale.layers,
        num_attention_heads=scale.heads,
        num_key_value_heads=scale.kv_heads,
        head_dim=scale.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(scale.layers)],
        linear_num_value_heads=scale.linear_value_heads,
        linear_num_key_heads=scale.linear_key_heads,
        linear_key_head_dim=scale.linear_head_dim,
        linear_value_head_dim=scale.linear_head_dim,
        linear_conv_kernel_dim=4,
    )
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config


def windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length - 1, (batch, 1), generator=generator, device="cpu")
    index = (starts + torch.arange(length + 1)).to(tokens.device)
    return tokens[index].long()


@contextlib.contextmanager
def reference_gated_delta_rule():
    """Train the fixture's Gated-DeltaNet layers on transformers' plain PyTorch code.

    fla 0.6's chunk backward refuses Triton 3.4 - 3.7.0 on Hopper (it computes wrong gradients there, fla issue
    #640), and the H200 has Triton 3.6. Only training needs the backward: every later stage (regenerate, harvest,
    eval) runs forward-only on fla's kernels again.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from dflash.kernels import GATED_DELTA_RULE

    fast = getattr(modeling, GATED_DELTA_RULE)
    setattr(modeling, GATED_DELTA_RULE, getattr(fast, "__wrapped__", fast))
    try:
        yield
    finally:
        setattr(modeling, GATED_DELTA_RULE, fast)


@reference_gated_delta_rule()
def train_target(
    scale: Scale,
    tokenizer,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    folder: Path,
    device: torch.device,
    sample_prompt: str,
    seed: int,
) -> dict:
    """Plain language modelling from scratch for `scale.target_seconds` of steady steps; save_pretrained."""
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(target_config(scale, tokenizer), dtype=torch.float32).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    logger.info(
        "target: %.1f M parameters (%.1f M without embedding / LM head), %d train tokens, %d held-out",
        params / 1e6,
        (params - embed) / 1e6,
        train_ids.size,
        heldout_ids.size,
    )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=scale.lr,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    train = torch.from_numpy(train_ids).to(device)
    heldout = torch.from_numpy(heldout_ids).to(device)
    generator = torch.Generator().manual_seed(seed)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def schedule(fraction: float) -> float:
        warm = 0.03
        if fraction < warm:
            return scale.lr * max(fraction / warm, 0.02)
        progress = min(1.0, (fraction - warm) / (1 - warm))
        return scale.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(lr: float) -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(windows(train, scale.batch, scale.seq_len, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    # The first steps pay for Triton autotuning (fla) and allocations: outside the steady time budget.
    t0 = time.perf_counter()
    step(scale.lr * 0.02)
    step(scale.lr * 0.02)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    logger.info("target: first 2 steps (autotuning, allocation) %.1f s", warmup_s)

    steps, losses, start = 0, [], time.perf_counter()
    log_every = 50 if cuda else 10
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= scale.target_seconds:
            break
        loss = step(schedule(elapsed / scale.target_seconds))
        steps += 1
        if steps % 10 == 0:
            losses.append(float(loss))  # one host sync per 10 steps
        if steps % log_every == 0:
            logger.info(
                "target step %d: loss %.3f, %.0f s, %.0f tokens/s",
                steps,
                losses[-1],
                elapsed,
                steps * scale.batch * scale.seq_len / max(elapsed, 1e-9),
            )
    _sync(device)
    seconds = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        heldout_loss = float(
            torch.stack([loss_of(windows(heldout, scale.batch, scale.seq_len, g)) for _ in range(8)]).mean()
        )
        g = torch.Generator().manual_seed(seed + 1)
        train_loss = float(
            torch.stack([loss_of(windows(train, scale.batch, scale.seq_len, g)) for _ in range(8)]).mean()
        )
        ids = torch.tensor([tokenizer(sample_prompt)["input_ids"]], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=min(96, scale.new_tokens),
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        sample = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    logger.info(
        "target: %d steps in %.0f s; train loss %.3f, held-out loss %.3f (nats/token)",
        steps,
        seconds,
        train_loss,
        heldout_loss,
    )
    logger.info("target sample (held-out prompt, greedy):\n%s\n>>>>>>>>\n%s\n<<<<<<<<", sample_prompt[-300:], sample)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = optimizer = train = heldout = None  # (the closures above hold them too)
    if cuda:
        torch.cuda.empty_cache()
    return {
        "parameters": params,
        "non_embedding_parameters": params - embed,
        "config": {
            k: getattr(scale, k)
            for k in (
                "hidden",
                "layers",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "linear_value_heads",
                "linear_key_heads",
                "linear_head_dim",
            )
        },
        "vocab_size": len(tokenizer),
        "autocast_bf16": cuda,
        "gated_delta_rule": "torch-reference (training only; see reference_gated_delta_rule)",
        "warmup_s": round(warmup_s, 2),
        "steps": steps,
        "tokens_seen": steps * scale.batch * scale.seq_len,
        "train_tokens": int(train_ids.size),
        "epochs": steps * scale.batch * scale.seq_len / max(train_ids.size, 1),
        "tokens_per_s": steps * scale.batch * scale.seq_len / max(seconds, 1e-9),
        "loss_curve_every_10_steps": [round(x, 4) for x in losses],
        "train_loss": train_loss,
        "heldout_loss": heldout_loss,
        "sample_prompt": sample_prompt,
        "sample_continuation": sample,
    }


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
