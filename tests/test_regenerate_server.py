"""`dflash regenerate --server`: through a real `transformers serve` of the tiny target, on the CPU.

Faults (5xx, a missing endpoint, a refused prompt, slow answers) come from a small proxy in front of the real server.
"""

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_regenerate import MAX_NEW_TOKENS, MULTI_TURN, PROMPTS, read_lines, write_jsonl

import dflash.regenerate.remote
from dflash.config import RegenerateConfig
from dflash.errors import DflashError
from dflash.regenerate import encode_prompt, eos_token_ids, regenerate
from dflash.regenerate.answers import load_prompts, prompt_records, settings_path
from dflash.regenerate.remote import Client, Refused, request_for
from dflash.target import load_target

SERVING = ("fastapi", "uvicorn", "openai", "pydantic", "starlette", "rich", "accelerate")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    """(URL, target folder) of `transformers serve` pinned to the tiny target, for the whole module."""
    missing = [name for name in SERVING if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"`transformers serve` needs {', '.join(missing)}: pip install -e '.[test]'")
    # Llama: transformers serve parses a Qwen answer (reasoning, tool calls) and strips the whitespace around it;
    # the answer of a Llama is the plain decode, as vLLM and SGLang give it without parsers.
    folder = tmp_path_factory.mktemp("serve")
    target = shutil.copytree(tiny_target("llama"), folder / "llama")
    # transformers serve samples only when the generation_config says so, as real targets' do (a greedy request
    # still turns it off).
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "do_sample": True}))
    port = free_port()
    command = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    log = folder / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    args = [command, "serve", str(target), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with open(log, "wb") as sink:
        process = subprocess.Popen(args + ["--dtype", "float32"], stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"transformers serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
    yield url, target
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


class Proxy:
    """An HTTP server forwarding to `upstream`, unless `fault(path, body)` answers `(status, json)` itself;
    `hold(body)` runs before a forwarded answer is sent back (and may keep it back)."""

    def __init__(self, upstream: str, fault=lambda path, body: None, hold=lambda body: None):
        proxy = self
        self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.answer(None)

            def do_POST(self):
                self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def answer(self, body):
                proxy.seen.append(self.path)
                status, payload = fault(self.path, body) or proxy.forward(self.path, body)
                if status == 200:
                    hold(body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.upstream = upstream
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, path, body):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.upstream + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:  # the server's refusals, passed on as they are
            return exc.code, json.loads(exc.read())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(served):
    proxies = []

    def make(**faults):
        proxies.append(Proxy(served[0], **faults))
        return proxies[-1]

    yield make
    for each in proxies:
        each.close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(dflash.regenerate.remote, "BACKOFF_START", 0.01)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


def server_config(url, prompts, out, **changes) -> RegenerateConfig:
    cfg = RegenerateConfig(None, str(prompts), str(out), server=url, max_new_tokens=MAX_NEW_TOKENS, concurrency=3)
    return dataclasses.replace(cfg, **changes)


@pytest.fixture(scope="module")
def through_server(served, prompts_file, tmp_path_factory):
    """The output of an uninterrupted greedy run through the server."""
    out = tmp_path_factory.mktemp("full") / "responses.jsonl"
    stats = regenerate(server_config(served[0], prompts_file, out), progress=False)
    assert (stats.prompts, stats.already_done, stats.written) == (5, 0, 5)
    return out


def answer(line: dict) -> str:
    return line["messages"][-1]["content"] if "messages" in line else line["completion"]


def test_greedy_answers_are_the_local_ones(served, prompts_file, through_server, tmp_path):
    url, target = served
    assert json.loads(settings_path(through_server).read_text())["model"] == str(target)
    local = tmp_path / "local.jsonl"
    regenerate(RegenerateConfig(target, prompts_file, local, max_new_tokens=MAX_NEW_TOKENS, device="cpu"), False)
    assert through_server.read_text() == local.read_text()

    # Token for token: each answer is the decode of transformers' greedy generate for that prompt alone. None holds a
    # special token, which the server would drop (it decodes with skip_special_tokens) and the local path keeps.
    model, tokenizer = load_target(target, "cpu", "float32")
    eos_ids = eos_token_ids(model, tokenizer)
    for record, line in zip(load_prompts(prompts_file), read_lines(through_server)):
        ids = torch.tensor([encode_prompt(tokenizer, record)])
        new = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        stop = next((i for i, t in enumerate(new) if t in eos_ids), len(new))
        assert not set(tokenizer.all_special_ids) & set(new[:stop])
        assert answer(line) == tokenizer.decode(new[:stop])
        # finish_reason "length": cut at max_tokens, marked so (on the turn, or on the completion record).
        mark = line["messages"][-1].get("unfinished") if "messages" in line else line.get("unfinished")
        assert mark is (True if stop == len(new) else None)


def test_turns_all_through_the_server_are_the_local_ones(served, tmp_path):
    """Every assistant turn of a multi-turn prompt is written in order, as the local path writes it."""
    url, target = served
    prompts_file = write_jsonl(tmp_path / "multi.jsonl", [PROMPTS[0], MULTI_TURN])
    remote, local = tmp_path / "remote.jsonl", tmp_path / "local.jsonl"
    regenerate(server_config(url, prompts_file, remote, turns="all"), progress=False)
    regenerate(RegenerateConfig(target, prompts_file, local, max_new_tokens=MAX_NEW_TOKENS, turns="all"), False)
    assert remote.read_text() == local.read_text()
    assert sum(m.get("target", False) for m in read_lines(remote)[1]["messages"]) == 2


def test_sampling_settings_go_with_every_request(served, prompts_file, through_server, tmp_path):
    cfg = server_config(served[0], prompts_file, tmp_path / "a.jsonl", temperature=0.8, top_p=0.9, seed=7)
    assert request_for({"prompt": "x"}, 3, "m", cfg)[1] == {
        "model": "m",
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 10,
        "prompt": "x",
    }
    assert request_for({"prompt": "x"}, 3, "m", dataclasses.replace(cfg, top_k=20))[1]["top_k"] == 20
    # One request at a time, so that the server's global seed is each request's own: the same answers twice.
    regenerate(dataclasses.replace(cfg, concurrency=1), progress=False)
    regenerate(dataclasses.replace(cfg, out=str(tmp_path / "b.jsonl"), concurrency=1), progress=False)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text() != through_server.read_text()


def test_resume_neither_repeats_nor_skips(served, prompts_file, through_server, tmp_path):
    from cli.main import main

    out = tmp_path / "responses.jsonl"
    first = write_jsonl(tmp_path / "first.jsonl", PROMPTS[:2])
    regenerate(server_config(served[0], first, out), progress=False)
    with open(out, "a") as handle:  # a run killed in the middle of writing line 3
        handle.write(through_server.read_text().splitlines(keepends=True)[2][:20])
    args = ["regenerate", "--server", served[0], "--data", str(prompts_file), "--out", str(out)]
    result = CliRunner().invoke(main, args + ["--max-new-tokens", str(MAX_NEW_TOKENS), "--concurrency", "2"])
    assert result.exit_code == 0, result.output
    assert "3 responses written, 2 already there, 5 prompts" in result.output
    assert out.read_text() == through_server.read_text()

    refused = CliRunner().invoke(main, args + ["--max-new-tokens", "4"])
    assert refused.exit_code == 2 and "other generation settings (max_new_tokens: the output has 10" in refused.output
    assert out.read_text() == through_server.read_text()


def prompt_number(body: dict | None) -> int | None:
    """Which prompt of PROMPTS (from 1) a request asks; None for a GET."""
    if body is None:
        return None
    asked = {"prompt": body["prompt"]} if "prompt" in body else {"messages": body["messages"]}
    return prompt_records(PROMPTS).index(asked) + 1


def test_answers_are_written_in_order_and_a_refused_prompt_keeps_the_ones_before(
    proxy, prompts_file, through_server, tmp_path
):
    # Prompt 1 answers last, prompt 4 is refused: prompts 1-3 are written, in order, and a rerun adds 4 and 5.
    def fault(path, body):
        if prompt_number(body) == 4:
            return 400, {"detail": "prompt too long"}

    faulty = proxy(fault=fault, hold=lambda body: time.sleep(1.0) if prompt_number(body) == 1 else None)
    out = tmp_path / "responses.jsonl"
    with pytest.raises(DflashError, match=r"refused prompt 4 at /v1/completions \(HTTP 400: prompt too long\)"):
        regenerate(server_config(faulty.url, prompts_file, out, concurrency=4), progress=False)
    assert out.read_text().splitlines() == through_server.read_text().splitlines()[:3]
    regenerate(server_config(proxy().url, prompts_file, out), progress=False)
    assert out.read_text() == through_server.read_text()


def test_a_killed_client_leaves_whole_answers_and_a_rerun_adds_the_rest(proxy, prompts_file, through_server, tmp_path):
    released = threading.Event()
    held = proxy(hold=lambda body: released.wait(60) if (prompt_number(body) or 0) >= 4 else None)
    out = tmp_path / "responses.jsonl"
    args = ["--server", held.url, "--data", str(prompts_file), "--out", str(out), "--max-new-tokens", "10"]
    client = subprocess.Popen(
        [sys.executable, "-m", "cli", "regenerate", *args, "--concurrency", "2"],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") == 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        client.kill()  # while prompts 4 and 5 are in flight
        client.wait()
    finally:
        released.set()
    assert out.read_text().splitlines() == through_server.read_text().splitlines()[:3]
    stats = regenerate(server_config(proxy().url, prompts_file, out), progress=False)
    assert (stats.already_done, stats.written) == (3, 2)
    assert out.read_text() == through_server.read_text()


def test_5xx_is_retried_with_backoff(proxy, prompts_file, through_server, tmp_path):
    failures = []

    def twice_503(path, body):
        if body and len(failures) < 2:
            failures.append(path)
            return 503, {"error": "overloaded"}

    flaky = proxy(fault=twice_503)
    out = tmp_path / "responses.jsonl"
    regenerate(server_config(flaky.url, prompts_file, out, retries=2), progress=False)
    assert out.read_text() == through_server.read_text()
    assert len(failures) == 2 and flaky.seen.count("/v1/chat/completions") + flaky.seen.count("/v1/completions") == 7

    down = proxy(fault=lambda path, body: (503, {"error": "overloaded"}) if body else None)
    with pytest.raises(DflashError, match=r"no answer from .* after 3 tries \(last: HTTP 503: overloaded\)"):
        regenerate(server_config(down.url, prompts_file, tmp_path / "down.jsonl", retries=2), progress=False)
    assert (tmp_path / "down.jsonl").read_text() == ""


def test_a_wrong_model_name_lists_the_served_ones(served, proxy):
    from cli.main import main

    url, target = served
    args = ["regenerate", "--server", url, "--server-model", "Qwen/Qwen3-8B", "--data", "x.jsonl", "--out", "y.jsonl"]
    with CliRunner().isolated_filesystem():
        write_jsonl(Path("x.jsonl"), PROMPTS)
        result = CliRunner().invoke(main, args)
        assert not Path("y.jsonl").exists()
    assert result.exit_code == 2
    assert f"does not serve 'Qwen/Qwen3-8B'; it serves {target}: give --server-model" in result.output

    # The server's own 4xx for a model it does not serve: not retried, its words passed on.
    body = {"model": "Qwen/Qwen3-8B", "messages": PROMPTS[0]["messages"], "max_tokens": 1}
    counted = proxy()
    with pytest.raises(Refused, match=f"HTTP 400: Server is pinned to '{target}'; requested 'Qwen/Qwen3-8B'"):
        Client(counted.url, timeout=10, retries=3).call("/v1/chat/completions", body)
    assert counted.seen == ["/v1/chat/completions"]


def test_a_server_without_completions_is_named(proxy, prompts_file, tmp_path):
    no_completions = proxy(
        fault=lambda path, body: (404, {"detail": "Not Found"}) if path == "/v1/completions" else None
    )
    with pytest.raises(DflashError, match="the server has no /v1/completions .* which text prompts need"):
        regenerate(server_config(no_completions.url, prompts_file, tmp_path / "out.jsonl"), progress=False)
    assert len(read_lines(tmp_path / "out.jsonl")) == 2  # the chat prompts before the first text prompt


def test_an_unreachable_server_is_a_clear_error(prompts_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DflashError, match=r"no answer from .*/v1/models after 2 tries \(last: cannot connect"):
        regenerate(server_config(url, prompts_file, tmp_path / "out.jsonl", retries=1), progress=False)


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "give --model .* or --server URL"),
        ({"model": "target", "server": "http://localhost:8000"}, "not both"),
        ({"server": "localhost:8000"}, "not an http"),
        ({"server": "http://localhost:8000", "concurrency": 0}, "--concurrency must be at least 1"),
        ({"server": "http://localhost:8000", "request_timeout": 0}, "--request-timeout must be positive"),
    ],
)
def test_bad_server_options_are_refused(options, message):
    with pytest.raises(DflashError, match=message):
        RegenerateConfig(data="p.jsonl", out="o.jsonl", **options)


class FakeServer:
    """An OpenAI-like server of one model that answers its first `answered` requests and then `stalls`: "hang"
    (never answers, until `release()`) or "503" (overloaded, until `release()`)."""

    def __init__(self, answered: int, stalls: str):
        server, self.posts, self.released = self, [], threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                path, body = self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.posts.append(path)
                if len(server.posts) > answered and not server.released.is_set():
                    if stalls == "503":
                        return self.send({"error": {"message": "overloaded"}}, 503)
                    server.released.wait()
                choice = {"text": "an answer"} if path == "/v1/completions" else {"message": {"content": "an answer"}}
                self.send({"choices": [{**choice, "finish_reason": "stop"}], "model": body["model"]})

            def send(self, payload, status=200):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except ConnectionError:  # a request of the interrupted client, answered once released
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self):
        self.released.set()

    def close(self):
        self.release()
        self.server.shutdown()
        self.server.server_close()


def test_ctrl_c_taken_by_a_request_thread_still_stops_the_run(tmp_path):
    """The kernel may hand a process's SIGINT to any of its threads; one taken by a request thread does not wake the
    main thread's wait for answers. The main thread waits in short slices, so it raises KeyboardInterrupt within one
    of them even though every request hangs."""
    hung = threading.Event()

    def ask(index):
        if index == 0:  # this request's thread takes the signal, then hangs like the others
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        hung.wait(30)
        return {"prompt": index}, 0

    class Bar:
        def update(self, n):
            pass

        def set_postfix_str(self, text, refresh):
            pass

    # Python's own Ctrl-C handler, as a command-line run has it (a suite started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    release = threading.Timer(10, hung.set)  # without the slices the main thread waits for this
    release.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            dflash.regenerate.remote.answer_in_order(ask, 0, 4, tmp_path / "out.jsonl", 2, Bar())
        assert time.monotonic() - started < 10 * dflash.regenerate.remote.SIGNAL_CHECK_SECONDS
    finally:
        hung.set()
        release.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("stalls", ["hang", "503"])
def test_ctrl_c_against_a_stalled_server_stops_at_once_and_the_rerun_resumes(stalls, prompts_file, tmp_path):
    server = FakeServer(answered=2, stalls=stalls)
    out = tmp_path / "responses.jsonl"
    args = ["--server", server.url, "--data", str(prompts_file), "--out", str(out), "--concurrency", "2"]
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    try:
        client = subprocess.Popen(
            [sys.executable, "-m", "cli", "regenerate", *args],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A suite started in the background (`make test &`) inherits SIGINT ignored, and Python then keeps it so.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") == 2 and len(server.posts) >= 4):
            assert time.monotonic() < deadline and client.poll() is None, client.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the stalled requests are in flight (or backing off)
        client.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        try:
            _, stderr = client.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            client.kill()
            pytest.fail(f"regenerate went on for 15 s after Ctrl-C:\n{client.communicate()[1][-2000:]}")
        assert time.monotonic() - interrupted < 5
        assert client.returncode == 2 and "Traceback" not in stderr and "Aborted!" not in stderr, stderr
        assert stderr.strip().splitlines()[-1] == (
            f"error: regenerate interrupted; the answers already in {out} are kept (whole lines): rerun the same "
            "command to resume after them"
        )
        assert len(read_lines(out)) == 2  # whole lines only
        server.release()
        stats = regenerate(server_config(server.url, prompts_file, out, concurrency=2), progress=False)
        assert (stats.already_done, stats.written) == (2, 3) and len(read_lines(out)) == 5
    finally:
        server.close()
