"""The quality run: does dflash train a drafter that works, on real text nobody here wrote? (bench/quality/README.md)

.venv/bin/python -m bench.quality --tiny --out /tmp/quality-tiny/quality.json   # toy sizes, CPU, minutes
source bench/device_setup.sh && python3 -m bench.quality --work /tmp/q --out $OUT/quality.json
"""

import argparse
import logging
import math
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

# fp32 dots in Triton kernels (fla's, at the fp32 eval) in IEEE rather than TF32: plain greedy decoding (one
# token per forward, fla's recurrent kernel) and the verify forwards (chunk kernel) then differ by fp32 rounding
# only, so a mismatch can only come from a true near-tie (its logit margin is reported) or a bug. fla still uses
# TF32 in one explicitly marked triangular solve of its chunk kernel.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import torch  # noqa: E402

from bench.quality.corpus import capped, make_prompts, stdlib_files, token_stream, write_jsonl  # noqa: E402
from bench.quality.drafter import drafter_steps, harvest_store, train_drafter  # noqa: E402
from bench.quality.evaluation import evaluate_all  # noqa: E402
from bench.quality.modes import run_modes  # noqa: E402
from bench.quality.regenerate import regenerate_on_all, response_stats  # noqa: E402
from bench.quality.report import bar, markdown, methods_markdown, mode_rows, modes_markdown  # noqa: E402
from bench.quality.run import Run, WorkFolderInUse  # noqa: E402
from bench.quality.scale import GPU, TINY, scale_with_overrides  # noqa: E402
from bench.quality.store_modes import mode_done, mode_harvested, parse_modes  # noqa: E402
from bench.quality.target import train_target  # noqa: E402
from dflash.tiny import build_tokenizer  # noqa: E402

logger = logging.getLogger("quality")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results (rewritten after every stage); a .log beside it")
    parser.add_argument(
        "--tiny", action="store_true", help="toy sizes for a CPU check (minutes); numbers are meaningless"
    )
    parser.add_argument("--work", help="working folder (target, prompts, store, run); default: a new one under /tmp")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a size or budget of the scale (repeatable), e.g. --set regen_seconds=120",
    )
    parser.add_argument(
        "--modes",
        default="",
        metavar="MODE,...",
        help="store modes to measure besides bf16 (issue 16): fp8, subK or subA/B, a subspace "
        "optionally +fp8, e.g. fp8,sub1/2,sub1/4,sub1/8,sub1/4+fp8",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="with --modes: evaluate the drafters a second time sampling at temperature T (lossless verification), "
        "after the temperature-0 eval (issue 23's table)",
    )
    parser.add_argument(
        "--stop-after",
        choices=[*Run.RESUMABLE, "modes"],
        help="end after this stage; a later call with the same --work goes on from there",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="delete a run of other sizes or seed found in --work (by default that is an error)",
    )
    args = parser.parse_args(argv)

    scale = scale_with_overrides(TINY if args.tiny else GPU, args.set, parser)
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.stop_after == "modes" and not modes:
        parser.error("--stop-after modes needs --modes")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Absolute: the paths saved in --work (the eval reports name the target and drafter) match on the next call.
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="dflash-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run = Run(out, scale, work, args.seed, args.restart)
    except WorkFolderInUse as exc:
        parser.error(str(exc))
    log = out.with_suffix(".log")
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(log, mode="w")],
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if device.type == "cuda":
        import fla  # noqa: F401 -- fail now, not after minutes of training, if the Triton kernels are missing
    elif not args.tiny:
        logger.warning("GPU sizes on the CPU: this will take hours; use --tiny")
    else:
        # One thread: on a small shared CPU, two spinning OpenMP threads next to another busy process run many
        # times slower than one.
        torch.set_num_threads(1)
    import transformers

    run.results.update(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        versions={
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        triton_f32_default=os.environ.get("TRITON_F32_DEFAULT"),
        triton_cache=os.environ.get("DFLASH_TRITON_CACHE", "cold"),  # "carried": compile times are not cold
        work=str(work),
    )
    logger.info("quality run, %s sizes, on %s; work folder %s", scale.name, run.results["device"], work)

    def stop_here(name: str) -> bool:
        if args.stop_after != name:
            return False
        logger.info("stopped after %s as asked; rerun with --work %s to go on from there", name, work)
        run.save()
        return True

    # 1. data
    def data():
        train, drafter_files, heldout, counts = stdlib_files(scale)
        run.results["data"] = counts
        train_texts = capped([train[n] for n in sorted(train)], scale.corpus_chars, args.seed)
        tokenizer = build_tokenizer(scale.vocab_size, capped(train_texts, scale.tokenizer_chars, args.seed + 1))
        train_ids = token_stream(tokenizer, train_texts)
        heldout_texts = capped([heldout[n] for n in sorted(heldout)], scale.corpus_chars, args.seed)
        heldout_ids = token_stream(tokenizer, heldout_texts)
        counts.update(
            target_train_chars=sum(map(len, train_texts)),
            train_tokens=int(train_ids.size),
            heldout_tokens=int(heldout_ids.size),
            chars_per_token=sum(map(len, train_texts)) / max(train_ids.size, 1),
        )
        logger.info("data: %s", counts)
        return drafter_files, heldout, tokenizer, train_ids, heldout_ids

    drafter_files, heldout, tokenizer, train_ids, heldout_ids = run.stage("data", 30 if not args.tiny else 20, data)
    eval_prompts = make_prompts(heldout, scale.eval_prompts, scale.prompt_chars, args.seed + 2, one_per_file=True)
    train_prompts = make_prompts(
        drafter_files, scale.train_prompts, scale.prompt_chars, args.seed + 3, one_per_file=False
    )
    val_prompts = make_prompts(heldout, scale.val_prompts, scale.prompt_chars, args.seed + 4, one_per_file=False)
    write_jsonl(work / "prompts_eval.jsonl", eval_prompts)
    write_jsonl(work / "prompts_train.jsonl", train_prompts)
    write_jsonl(work / "prompts_val.jsonl", [{"text": p["text"]} for p in val_prompts])

    # 2. target
    target = work / "target"
    target_budget = scale.target_seconds + (30 if device.type == "cuda" else 5)  # + first steps, loss, save
    run.stage(
        "target",
        target_budget,
        lambda: train_target(
            scale, tokenizer, train_ids, heldout_ids, target, device, eval_prompts[0]["text"], args.seed
        ),
        keep=True,
    )
    if stop_here("target"):
        return 0

    # 3. regenerate
    def regen():
        from dflash.config import RegenerateConfig
        from dflash.regenerate import regenerate

        info = regenerate_on_all(scale, target, train_prompts, work, device, scale.regen_seconds, log)
        info.update(response_stats(tokenizer, Path(info["file"])))
        regenerate(
            RegenerateConfig(
                str(target),
                str(work / "prompts_val.jsonl"),
                str(work / "responses_val.jsonl"),
                max_new_tokens=scale.new_tokens,
                batch_size=scale.regen_batch,
                device=device.type,
                dtype="float32",
            ),
            progress=False,
        )
        info["val_file"] = str(work / "responses_val.jsonl")
        logger.info("regenerate: %s", {k: v for k, v in info.items() if k != "sample_response"})
        logger.info("sample response:\n%s", info["sample_response"][:400])
        return info

    run.stage("regenerate", scale.regen_seconds + 10, regen, keep=True)
    if stop_here("regenerate"):
        return 0

    # 4. harvest
    def harvest():
        from dflash.store import Store, disk_bytes

        shards = harvest_store(scale, target, run.results["regenerate"]["file"], work / "shards", device)
        val_shards = harvest_store(scale, target, run.results["regenerate"]["val_file"], work / "shards_val", device)
        counts = asdict(Store.open(shards).manifest.counts)
        val_rows = Store.open(val_shards).num_rows
        return {
            **counts,
            "store_mb": disk_bytes(shards) / 1e6,
            "path": str(shards),
            "val_path": str(val_shards),
            "val_rows": val_rows,
        }

    run.stage("harvest", 30 if device.type == "cuda" else 20, harvest, keep=True)
    if stop_here("harvest"):
        return 0

    # 5. drafter
    def drafter():
        rows = run.results["harvest"]["rows"]
        steps = drafter_steps(scale, rows)
        logger.info(
            "drafter: %d train rows, %d rows per step, %d steps (%.1f epochs); held-out store of %d rows",
            rows,
            scale.rows_per_step,
            steps,
            steps * scale.rows_per_step / max(rows, 1),
            run.results["harvest"]["val_rows"],
        )
        return train_drafter(
            scale,
            run.results["harvest"]["path"],
            run.results["harvest"]["val_path"],
            work / "run",
            steps,
            device,
            args.seed,
        )

    run.stage("drafter", scale.drafter_seconds, drafter, keep=True)
    if stop_here("drafter"):
        return 0

    # 6. store modes (issue 16)
    mode_drafters = None
    if modes:
        untrained = sum(not mode_done(run.stages, m.folder).exists() for m in modes)
        unharvested = sum(not mode_harvested(run.stages, m.folder).exists() for m in modes)
        harvests = math.ceil(unharvested / max(scale.mode_workers, 1)) * (60 if device.type == "cuda" else 40)
        budget = harvests + math.ceil(untrained / max(scale.mode_train_workers, 1)) * scale.drafter_seconds
        run.stage(
            "modes",
            budget,
            lambda: run_modes(scale, modes, target, run.results, work, run.stages, device, args.seed, log),
            keep=True,
        )
        if stop_here("modes"):
            return 0
        mode_drafters = {m.method: run.results["modes"][m.name]["drafter"]["export"] for m in modes}

    # 7. eval: temperature 0 (with plain greedy's mismatch check and the baselines), then sampled if asked
    sampled_eval = bool(modes and args.temperature)

    def eval_stage(name: str, temperature: float, evals_left: int = 1):
        # what is left is shared by the evals still to run: the greedy one must not leave the sampled one nothing
        budget = max(0.0, min(scale.eval_seconds, (run.left() - 10) / evals_left))
        return run.stage(
            name,
            budget,
            lambda: evaluate_all(
                scale,
                target,
                Path(run.results["drafter"]["export"]),
                eval_prompts,
                device,
                budget,
                args.seed,
                work,
                log,
                modes=mode_drafters,
                temperature=temperature,
            ),
        )

    report, complete = eval_stage("eval", 0.0, evals_left=2 if sampled_eval else 1)
    run.results["eval"] = asdict(report)
    run.results["bar"] = bar(report, complete)
    if not complete:
        logger.info(
            "eval: %d of %d held-out prompts done; the bar below is PARTIAL: rerun with --work %s to go on",
            len(report.prompts),
            len(eval_prompts),
            work,
        )
    sampled = None
    if sampled_eval:
        name = f"eval_T{args.temperature:g}"
        sampled, sampled_complete = eval_stage(name, args.temperature)
        run.results[name] = asdict(sampled)
        complete = complete and sampled_complete
    table = markdown(run.results, report)
    run.results["table"] = table
    if modes:
        rows = mode_rows(report, complete, run.results["modes"], sampled)
        steps = drafter_steps(scale, run.results["harvest"]["rows"])
        store_rows = [r for r in rows if not r["train"]]
        method_rows = [rows[0], *(r for r in rows if r["train"])]
        parts = {"rows": rows}
        if len(store_rows) > 1:
            parts["markdown"] = modes_markdown(store_rows, report, complete, steps)
        if len(method_rows) > 1:
            parts["methods_markdown"] = methods_markdown(method_rows, complete, steps, args.temperature)
        run.results["modes_table"] = parts
        table += "".join("\n\n" + parts[k] for k in ("markdown", "methods_markdown") if k in parts)
    run.save()
    logger.info("wrote %s (%.0f s in all)", out, run.elapsed())
    print("\n" + table, flush=True)
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
