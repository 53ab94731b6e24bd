"""`dflash regenerate --server URL`: the target's answers from an OpenAI-compatible serving engine (vLLM, SGLang,
`transformers serve`) instead of a local transformers generate.

Prompts, output and resuming are dflash.regenerate.answers', shared with the local path (dflash.regenerate): chat prompts go
to `/v1/chat/completions` (the server applies the target's chat template), text prompts to `/v1/completions`.
`--concurrency` requests are in flight; an answer
that arrives before an earlier prompt's waits in memory, and only the in-order prefix is appended (whole lines, one
fsynced write), so output line i always answers prompt i and a rerun resumes after the last whole line. The model
name the server serves the target under, and the sampling settings, are recorded in `OUT.settings.json`.

The stored answer is the server's text: token ids are not part of the OpenAI API (each engine has its own way to
return them). The server decodes without special tokens, so a special token the target wrote inside an answer is
dropped, where the local path keeps it; otherwise greedy answers are the local ones.
"""

import http.client
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

from dflash.config import RegenerateConfig
from dflash.errors import DflashError
from dflash.regenerate.answers import (
    RegenerateStats,
    answer_records,
    answerable_prompts,
    append_lines,
    check_output,
    completed_count,
    generation_settings,
    output_counts,
    output_path,
    plain_messages,
)

log = logging.getLogger("dflash")

BACKOFF_START = 1.0  # seconds before the first retry, doubled for each next one
BACKOFF_MAX = 60.0
BUFFER_PER_REQUEST = 16  # answers held for writing, per request in flight, behind a slow earlier prompt
# The main thread waits for answers at most this long at a time: a Ctrl-C the kernel hands to a request thread
# (any thread may take a process's signal) does not wake the main thread's lock wait, only its next bytecode does.
SIGNAL_CHECK_SECONDS = 0.2
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Retryable(Exception):
    """A failure that may pass: a 5xx, 408 or 429 answer, a timeout, no connection."""


class Refused(Exception):
    """A 4xx answer: the request itself is wrong, and sending it again will not help."""

    def __init__(self, code: int, detail: str):
        super().__init__(f"HTTP {code}: {detail}")
        self.code = code
        self.detail = detail


class Stopped(Exception):
    """The run was stopped (Ctrl-C): no more tries."""


class Client:
    """JSON over HTTP to one server, retrying what may pass with exponential backoff until `stop()`."""

    def __init__(self, url: str, timeout: float, retries: int):
        base = url.rstrip("/")
        self.base = base.removesuffix("/v1")  # `http://host:8000/v1`, as OpenAI clients take it, works too
        self.timeout = timeout
        self.retries = retries
        self.stopped = threading.Event()

    def stop(self) -> None:
        """No request is sent, and no backoff waited out, from now on (calls in flight raise Stopped)."""
        self.stopped.set()

    def call(self, path: str, body: dict | None = None) -> dict:
        """GET `path`, or POST `body` to it; raises Refused on a 4xx, DflashError once the retries are spent,
        Stopped once `stop()` was called."""
        for attempt in range(self.retries + 1):
            if self.stopped.is_set():
                raise Stopped
            try:
                return self._once(path, body)
            except Retryable as exc:
                last = exc
                if attempt < self.retries:
                    delay = min(BACKOFF_START * 2**attempt, BACKOFF_MAX)
                    log.warning("%s%s: %s; retrying in %.1f s", self.base, path, exc, delay)
                    if self.stopped.wait(delay):
                        raise Stopped from None
        raise DflashError(
            f"no answer from {self.base}{path} after {self.retries + 1} tries (last: {last}); check that the server "
            "is up at that address, or give it more time with --retries and --request-timeout"
        )

    def _once(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:  # before URLError, its base class
            detail = _detail(exc)
            if exc.code >= 500 or exc.code in (408, 429):
                raise Retryable(f"HTTP {exc.code}: {detail}") from None
            raise Refused(exc.code, detail) from None
        except urllib.error.URLError as exc:
            raise Retryable(f"cannot connect ({exc.reason})") from None
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            raise Retryable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
        try:
            return json.loads(payload)
        except ValueError:
            raise DflashError(f"{self.base}{path} did not answer JSON: {payload[:200]!r}") from None


def _detail(exc: urllib.error.HTTPError) -> str:
    """The server's own words: OpenAI's `{"error": {"message"}}`, vLLM's older `{"message"}`, FastAPI's
    `{"detail"}`, or the raw body."""
    raw = exc.read().decode("utf-8", "replace")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return raw[:300] or str(exc.reason)
    error = body.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(body.get("message") or body.get("detail") or error or raw)[:300]


def served_model(client: Client, wanted: str | None) -> tuple[str, list[str]]:
    """The model to request (`--server-model`, or the only one served), checked against `/v1/models`; and the
    names served, for error messages."""
    try:
        listing = client.call("/v1/models")
        names = [entry["id"] for entry in listing["data"]]
    except Refused as exc:
        raise DflashError(
            f"{client.base}/v1/models answered {exc}; --server must be an OpenAI-compatible server "
            "(vLLM, SGLang, transformers serve), e.g. http://localhost:8000"
        ) from None
    except (KeyError, TypeError):
        raise DflashError(f"{client.base}/v1/models is not an OpenAI model list: {str(listing)[:200]}") from None
    if wanted is None and len(names) == 1:
        return names[0], names
    if wanted is None or wanted not in names:
        given = f"does not serve {wanted!r}" if wanted else "serves several models"
        raise DflashError(
            f"{client.base} {given}; it serves {', '.join(names) or 'none'}: give --server-model with one of them"
        )
    return wanted, names


def request_for(record: dict, index: int, model: str, cfg: RegenerateConfig) -> tuple[str, dict]:
    """The endpoint and body answering prompt `index` with `cfg`'s settings."""
    body = {"model": model, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
    if cfg.temperature > 0:
        # Seeded by position, as the local path: a resumed run does not repeat the first run's random stream.
        body.update(top_p=cfg.top_p, seed=cfg.seed + index)
        if cfg.top_k > 0:  # not an OpenAI field: vLLM and SGLang take it, others may refuse it
            body["top_k"] = cfg.top_k
    if "prompt" in record:
        return COMPLETIONS, {**body, "prompt": record["prompt"]}
    return CHAT, {**body, "messages": plain_messages(record["messages"])}


def answer_text(path: str, response: dict) -> str:
    try:
        choice = response["choices"][0]
        if path == COMPLETIONS:
            text = choice["text"]
        else:
            message = choice["message"]
            if message.get("reasoning_content") or message.get("reasoning") or message.get("tool_calls"):
                raise DflashError(
                    "the server parsed reasoning or tool calls out of the target's answer; the answer to train on "
                    "is the whole text: serve the target without reasoning and tool-call parsers (vLLM and SGLang: "
                    "leave out --reasoning-parser and --tool-call-parser)"
                )
            text = message["content"] or ""  # None when the answer is empty
    except (KeyError, IndexError, TypeError, AttributeError):
        text = None
    if not isinstance(text, str):
        raise DflashError(f"the server's answer at {path} is not an OpenAI completion: {str(response)[:300]}")
    return text


def cut_off(response: dict) -> bool:
    """Whether the server stopped the answer at max_tokens rather than at the target's end of turn."""
    return response["choices"][0].get("finish_reason") == "length"


def refusal(exc: Refused, path: str, index: int, names: list[str]) -> DflashError:
    if path == COMPLETIONS and exc.code in (404, 405):
        return DflashError(
            f"the server has no {COMPLETIONS} ({exc}), which text prompts need: serve the target with vLLM or "
            "SGLang, or give chat prompts"
        )
    return DflashError(
        f"the server refused prompt {index + 1} at {path} ({exc}); it serves {', '.join(names)}: fix the request "
        "(--server-model, --max-new-tokens within the model's context, sampling options) and rerun to resume"
    )


def regenerate_remote(cfg: RegenerateConfig, progress: bool = True) -> RegenerateStats:
    """Answer every prompt of `cfg.data` through the server at `cfg.server`, appending to `cfg.out` (resumable)."""
    from tqdm import tqdm

    records = answerable_prompts(cfg.data, "regenerate answers")
    out = output_path(cfg)
    client = Client(cfg.server, cfg.request_timeout, cfg.retries)
    model, names = served_model(client, cfg.server_model)
    check_output(out, generation_settings(cfg, model))
    done = completed_count(out, records, cfg.turns)
    if done == len(records):
        return RegenerateStats(len(records), done, 0, *output_counts(out))

    def ask(index: int) -> tuple[dict, int]:
        tokens = 0

        def generate(prompts: list[dict]) -> list[tuple[str, bool]]:  # one prompt: this conversation's next turn
            nonlocal tokens
            path, body = request_for(prompts[0], index, model, cfg)
            try:
                response = client.call(path, body)
            except Refused as exc:
                raise refusal(exc, path, index, names) from None
            tokens += (response.get("usage") or {}).get("completion_tokens") or 0
            return [(answer_text(path, response), cut_off(response))]

        [record] = answer_records([records[index]], cfg.turns, generate)
        return record, tokens

    log.info(
        "regenerate: %d prompts through %s (%s), %d in flight", len(records) - done, client.base, model, cfg.concurrency
    )
    bar = tqdm(total=len(records), initial=done, unit="answer", desc="regenerate", disable=not progress)
    started = time.monotonic()
    try:
        tokens = answer_in_order(ask, done, len(records), out, cfg.concurrency, bar)
    finally:
        client.stop()  # a Ctrl-C: the requests still in flight try no more
        bar.close()
    seconds = max(time.monotonic() - started, 1e-6)
    rate = f", {tokens / seconds:.0f} tokens/s" if tokens else ""
    log.info(
        "regenerate: %d answers in %.1f s: %.2f answers/s%s",
        len(records) - done,
        seconds,
        (len(records) - done) / seconds,
        rate,
    )
    return RegenerateStats(len(records), done, len(records) - done, *output_counts(out))


def answer_in_order(ask, start: int, end: int, out: Path, concurrency: int, bar) -> int:
    """Run `ask(i)` for i in [start, end), `concurrency` at a time, appending the answers to `out` in prompt order
    as soon as every earlier one is there; returns the tokens generated (as the server reports them). When a prompt
    fails, the prompts before it are still answered and written, so that a rerun resumes from there."""
    ready: dict[int, dict] = {}
    pending = {}
    next_out = next_in = start
    tokens = 0
    failure = None
    started = time.monotonic()
    pool = DaemonPool(concurrency)
    try:
        while next_out < end:
            # Never more than the pool runs at once, and a bounded buffer behind a slow prompt.
            while (
                next_in < end and len(pending) < concurrency and next_in - next_out < BUFFER_PER_REQUEST * concurrency
            ):
                pending[pool.submit(ask, next_in)] = next_in
                next_in += 1
            finished, _ = wait(pending, timeout=SIGNAL_CHECK_SECONDS, return_when=FIRST_COMPLETED)
            for future in finished:
                index = pending.pop(future)
                try:
                    ready[index], count = future.result()
                except DflashError as exc:
                    if index < end:
                        end, failure = index, exc
                    continue
                tokens += count
                bar.update(1)
                if tokens:
                    bar.set_postfix_str(f"{tokens / (time.monotonic() - started):.0f} tok/s", refresh=False)
            lines = []
            while next_out < end and next_out in ready:
                lines.append(ready.pop(next_out))
                next_out += 1
            if lines:
                append_lines(out, lines)
    finally:
        pool.shutdown()
    if failure:
        raise failure
    return tokens


class DaemonPool:
    """`submit(fn, arg) -> Future`, run by `workers` daemon threads: unlike ThreadPoolExecutor's, whose threads
    the interpreter joins at exit, a thread waiting on a hung server never keeps a stopped run (Ctrl-C) alive."""

    def __init__(self, workers: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.workers = workers
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True, name="dflash-request").start()

    def submit(self, fn, arg) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, arg))
        return future

    def shutdown(self) -> None:
        """Cancel the jobs not started; each worker ends after its current one."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            job[0].cancel()
        for _ in range(self.workers):
            self.jobs.put(None)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn, arg = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(arg))
                except BaseException as exc:  # handed to the caller through the future
                    future.set_exception(exc)
