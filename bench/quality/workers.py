"""Jobs in worker processes spread over the GPUs, each logging to the run's log."""

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger("quality")


def gpu_count(device: torch.device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0


def in_workers(fn, jobs: list[dict], gpus: int, log: Path, at_once: int | None = None, names: list[str] | None = None):
    """fn(**job) in a spawned process per job, job i on GPU i % gpus (the CPU when gpus is 0), at most `at_once`
    of them running at a time (default: all); fails if one fails, after all have ended.

    Each worker sees one GPU (CUDA_VISIBLE_DEVICES, inherited at spawn), so its reports name the device cuda:0
    like the parent's, and logs to the run's log file, its lines prefixed with its name (default "worker i/N").
    """
    context = multiprocessing.get_context("spawn")
    workers, environment = [], dict(os.environ)
    names = names or [f"worker {i}/{len(jobs)}" for i in range(len(jobs))]
    for i, job in enumerate(jobs):
        while at_once and sum(w.exitcode is None for w in workers) >= at_once:
            multiprocessing.connection.wait([w.sentinel for w in workers if w.exitcode is None])
        try:
            if gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
            workers.append(context.Process(target=_worker, args=(fn, job, str(log), names[i])))
            workers[-1].start()
        finally:
            os.environ.clear()
            os.environ.update(environment)
    for worker in workers:
        worker.join()
    failed = {i: w.exitcode for i, w in enumerate(workers) if w.exitcode != 0}
    if failed:
        raise RuntimeError(f"workers {failed} (index: exit code) failed; their errors are in {log}")


def _worker(fn, job: dict, log: str, name: str):
    from transformers.utils import logging as hf_logging

    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(name)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(log, mode="a")],
    )
    hf_logging.set_verbosity_error()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # several workers share a small CPU
    try:
        fn(**job)
    except BaseException:
        logger.exception("%s failed", name)
        raise
