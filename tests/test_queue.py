"""bench/queue.sh: a plan's commands run in order in the background, each with its own results folder, and a poll
that reports their exit status and packs everything into one file."""

import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def queue(*args, env):
    return subprocess.run(["bash", "bench/queue.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def wait_for(status: Path, text: str, seconds: float = 60) -> str:
    deadline = time.monotonic() + seconds
    while not status.exists() or text not in status.read_text():
        assert time.monotonic() < deadline, status.read_text() if status.exists() else "no status"
        time.sleep(0.1)
    return status.read_text()


def test_a_queue_runs_its_plan_in_order_and_a_poll_copies_the_results(tmp_path):
    setup = tmp_path / "setup.sh"
    setup.write_text("export FROM_SETUP=yes\n")
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": str(setup)}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "no-triton-cache")  # none compiled: none packed
    plan = tmp_path / "plan.tsv"
    plan.write_text(
        "# first the one that writes a file, then one that fails, then one after it\n\n"
        'writes\techo "$FROM_SETUP" > "$RESULTS/out.txt"; pwd > "$RESULTS/cwd"; echo done\n'
        "fails\techo partial; exit 3\n"
        "after\tsleep 0.2; echo last\n"
    )
    started = queue("start", str(plan), env=env)
    assert started.returncode == 0 and "3 commands" in started.stdout, started.stderr
    assert queue("start", str(plan), env=env).returncode == 2  # one queue at a time
    wait_for(tmp_path / "queue" / "status", "queue done")
    polled = queue("poll", str(tmp_path / "polled"), env=env)
    assert polled.returncode == 0
    ends = [line.split(" end ")[1] for line in polled.stdout.splitlines() if " end " in line]
    assert ends == ["writes: exit 0", "fails: exit 3", "after: exit 0"]
    assert [p.name for p in (tmp_path / "polled").iterdir()] == ["queue.tar.gz"]  # a call brings back 8 files
    out = tmp_path / "out"
    with tarfile.open(tmp_path / "polled" / "queue.tar.gz") as packed:
        packed.extractall(out, filter="data")
    assert (out / "writes" / "out.txt").read_text() == "yes\n"  # after the setup, in its own results folder
    assert (out / "fails.log").read_text() == "partial\n" and (out / "after.log").read_text() == "last\n"
    # run in a copy of the tree (a later device call re-syncs the working tree), which the poll leaves behind
    assert (out / "writes" / "cwd").read_text().strip() == str(tmp_path / "queue" / "repo")
    assert (tmp_path / "queue" / "repo" / "bench" / "queue.sh").exists() and not (out / "repo").exists()


def test_a_queue_of_named_lines_runs_those_only_in_the_plans_order(tmp_path):
    setup = tmp_path / "setup.sh"
    setup.write_text("true\n")
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": str(setup)}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "no-triton-cache")
    plan = tmp_path / "plan.tsv"
    plan.write_text("# lines\none\techo 1\ntwo\techo 2\n\nthree\techo 3\n")
    refused = queue("start", str(plan), "three", "four", env=env)
    assert refused.returncode == 2 and "no line four" in refused.stderr and "one two three" in refused.stderr
    assert not (tmp_path / "queue").exists()  # refused before anything started
    started = queue("start", str(plan), "three", "one", env=env)
    assert started.returncode == 0 and "2 commands (one three)" in started.stdout, started.stderr
    status = wait_for(tmp_path / "queue" / "status", "queue done")
    assert [line.split(" end ")[1] for line in status.splitlines() if " end " in line] == [
        "one: exit 0",
        "three: exit 0",
    ]


def test_a_poll_packs_the_triton_cache_as_device_setup_unpacks_it(tmp_path):
    setup = tmp_path / "setup.sh"
    setup.write_text("true\n")
    cache = tmp_path / "triton"
    (cache / "abc").mkdir(parents=True)
    (cache / "abc" / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": str(setup)}
    plan = tmp_path / "plan.tsv"
    plan.write_text("one\ttrue\n")
    assert queue("start", str(plan), env={**env, "TRITON_CACHE_DIR": str(tmp_path / "none")}).returncode == 0
    wait_for(tmp_path / "queue" / "status", "queue done")
    assert queue("poll", str(tmp_path / "polled"), env={**env, "TRITON_CACHE_DIR": str(cache)}).returncode == 0
    assert sorted(p.name for p in (tmp_path / "polled").iterdir()) == ["queue.tar.gz", "triton.tar.xz"]
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(  # device_setup.sh's own unpacking
        ["tar", "-xJf", str(tmp_path / "polled" / "triton.tar.xz"), "-C", str(unpacked), "--strip-components=1"],
        check=True,
    )
    assert (unpacked / "abc" / "kernel.cubin").read_bytes() == (cache / "abc" / "kernel.cubin").read_bytes()


def test_the_queue_outlives_the_session_of_the_call_that_started_it(tmp_path):
    """The device kills every process a call leaves in its session when the call returns; the runner has its own."""
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": "/dev/null"}
    plan = tmp_path / "plan.tsv"
    plan.write_text("slow\tsleep 1; echo survived\n")
    call = subprocess.Popen(
        ["bash", "-c", f"bash bench/queue.sh start {plan} && sleep 60"], cwd=ROOT, env=env, start_new_session=True
    )
    wait_for(tmp_path / "queue" / "status", "start slow")
    os.killpg(call.pid, signal.SIGKILL)  # the call returns: its session goes
    call.wait()
    assert "slow: exit 0" in wait_for(tmp_path / "queue" / "status", "queue done")
    assert (tmp_path / "queue" / "slow.log").read_text() == "survived\n"


def test_a_poll_waits_for_the_queue_to_end_and_no_longer(tmp_path):
    """Device time counts while a call holds the machine: a poll's wait ends when the queue does, or at its limit."""
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": "/dev/null"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "none")
    plan = tmp_path / "plan.tsv"
    plan.write_text("short\tsleep 1; echo ok\n")
    assert queue("start", str(plan), env=env).returncode == 0
    began = time.monotonic()
    polled = queue("poll", str(tmp_path / "polled"), "120", env=env)
    assert "short: exit 0" in polled.stdout and "queue done" in polled.stdout
    assert time.monotonic() - began < 30  # ended with the queue, not after 120 s

    plan.write_text("long\tsleep 30\n")
    env["QUEUE_DIR"] = str(tmp_path / "queue2")
    assert queue("start", str(plan), env=env).returncode == 0
    began = time.monotonic()
    polled = queue("poll", str(tmp_path / "polled2"), "2", env=env)
    waited = time.monotonic() - began
    assert 2 <= waited < 20 and "queue done" not in polled.stdout, (waited, polled.stdout)
    assert (tmp_path / "polled2" / "queue.tar.gz").exists()


def test_a_failed_setup_stops_the_queue_before_any_command(tmp_path):
    env = {**os.environ, "QUEUE_DIR": str(tmp_path / "queue"), "QUEUE_SETUP": str(tmp_path / "missing.sh")}
    plan = tmp_path / "plan.tsv"
    plan.write_text("never\ttouch never_ran\n")
    assert queue("start", str(plan), env=env).returncode == 0
    assert "setup failed" in wait_for(tmp_path / "queue" / "status", "queue stopped")
    assert not (tmp_path / "queue" / "never.log").exists()


def test_the_committed_plans_are_name_tab_command_lines_of_the_repositorys_scripts():
    for plan in sorted((ROOT / "bench" / "plans").glob("*.tsv")):
        lines = [line for line in plan.read_text().splitlines() if line.strip() and not line.startswith("#")]
        names = [line.split("\t")[0] for line in lines]
        assert lines and all(line.count("\t") == 1 for line in lines), plan
        assert len(set(names)) == len(names) and all(name.isidentifier() for name in names), names
        for line in lines:
            script = line.split("\t")[1].split()[1]  # python3 SCRIPT ...
            assert script == "-m" or (ROOT / script).is_file(), (plan.name, line)
