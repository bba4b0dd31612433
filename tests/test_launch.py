"""launch.sh (behind every run_*.sh): how many processes it starts, and what it refuses."""

import os
import re
import signal
import socket
import time

import pytest
from conftest import (
    ROOT,
    Run,
    alive,
    assert_one_line_error,
    free_port,
    launcher_env,
    mnist_args,
    our_lines,
    wait_for,
    worker_pids,
)

from plumbing import failures


def in_mask(pid, field, number):
    """Whether signal ``number`` is in process ``pid``'s /proc mask ``field``: SigCgt (it has a
    handler of its own), ShdPnd (sent to the whole process, waiting)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line for line in f if line.startswith(f"{field}:")).split()[1]
    return bool(int(mask, 16) >> (number - 1) & 1)


def wait_until(condition, what, run, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        if run.process.poll() is not None or time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"never saw {what}:\n{run.output[-3000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("moment", ["torchrun-importing-torch", "workers-starting"])
def test_ctrl_c_during_start_up_is_one_line_and_exit_code_130(moment, tmp_path):
    # No NPROC_PER_NODE: launch.sh counts the GPUs torch sees. nvidia-smi lists every GPU of the
    # machine, also those CUDA_VISIBLE_DEVICES hides (here: all of them), so a fake one lists 8:
    # with none for torch, 2 CPU processes.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
    )
    (fake / "nvidia-smi").chmod(0o755)
    env = launcher_env()
    env.pop("NPROC_PER_NODE", None)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    run = Run(
        ["bash", ROOT / "run_ddp.sh", "--dataset", "synthetic", "--max-steps", "1", "--no-eval"],
        env=env,
    )
    # bash execs torchrun (launch_torchrun.py): the launch is its process
    launcher = run.process.pid
    # its first lines set a handler for SIGUSR1, which Python has not
    if moment == "torchrun-importing-torch":
        wait_until(
            lambda: alive(launcher) and in_mask(launcher, "SigCgt", signal.SIGUSR1),
            "torchrun's first handler",
            run,
        )
    else:
        wait_until(lambda: len(worker_pids(launcher)) == 2, "two workers", run)
    processes = [launcher, *worker_pids(launcher).values()]
    # what a terminal does on Ctrl-C: the foreground process group
    os.killpg(launcher, signal.SIGINT)
    run.wait(timeout=60)
    assert run.returncode == 130, run.output
    # launch.sh's command line, said first
    assert "torchrun --standalone --nproc-per-node=2 " in run.output
    assert our_lines(run.output) == [
        "stopped by SIGINT during start-up: nothing was trained or saved"
    ], run.output
    # the workers die with torchrun (PR_SET_PDEATHSIG): soon after it
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in processes if alive(pid)]


# Bad launcher variables, every case in one table: (environment, the error line it must give).
# {busy} is a port something listens on, {free} and {free2} ports nobody does. The waiting cases
# wait JOIN_TIMEOUT=3 s.
NODE_1 = {"NNODES": 2, "NODE_RANK": 1, "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": 1}
NODE_0 = {**NODE_1, "NODE_RANK": 0}
BAD_VARIABLES = {
    "nproc-0": (
        {"NPROC_PER_NODE": 0},
        "NPROC_PER_NODE must be a positive integer (processes on this node), got '0'",
    ),
    "nproc-word": (
        {"NPROC_PER_NODE": "abc"},
        "NPROC_PER_NODE must be a positive integer (processes on this node), got 'abc'",
    ),
    "nnodes-0": ({"NNODES": 0}, "NNODES must be a positive integer (the number of nodes), got '0'"),
    "node-rank-past-nnodes": (
        {**NODE_1, "NODE_RANK": 2},
        "NODE_RANK must be 0 to 1 with NNODES=2, got '2'",
    ),
    "node-rank-negative": ({"NODE_RANK": -1}, "NODE_RANK must be 0 to 0 with NNODES=1, got '-1'"),
    "master-port-0": ({"MASTER_PORT": 0}, "MASTER_PORT must be a port number, 1 to 65535, got '0'"),
    "master-port-70000": (
        {"MASTER_PORT": 70000},
        "MASTER_PORT must be a port number, 1 to 65535, got '70000'",
    ),
    "max-restarts-negative": (
        {"MAX_RESTARTS": -1},
        "MAX_RESTARTS must be an integer, 0 or more, got '-1'",
    ),
    "join-timeout-0": (
        {"JOIN_TIMEOUT": 0},
        "JOIN_TIMEOUT must be a positive integer (seconds), got '0'",
    ),
    # 850 MB each: more processes than any machine's memory holds
    "nproc-past-memory": (
        {"NPROC_PER_NODE": 10**8},
        "NPROC_PER_NODE=100000000 processes need about 85000000000 MB of "
        "memory (850 MB each), but this node has",
    ),
    "no-master-addr": (
        {"NNODES": 2, "NODE_RANK": 1},
        "NNODES=2 needs MASTER_ADDR, node 0's address",
    ),
    # several nodes: what torchrun reports in a 40- to 80-line traceback, or after 10 silent minutes
    "master-port-in-use": (
        {**NODE_0, "MASTER_PORT": "{busy}"},
        "node 0 cannot listen on MASTER_PORT={busy} (Address already in use): pick another",
    ),
    "master-addr-unresolvable": (
        {**NODE_1, "MASTER_ADDR": "no-such-host.invalid"},
        "MASTER_ADDR=no-such-host.invalid does not resolve on this node",
    ),
    "node-0-never-answers": (
        {**NODE_1, "MASTER_PORT": "{free}", "JOIN_TIMEOUT": 3},
        "nothing answered at MASTER_ADDR:MASTER_PORT=127.0.0.1:{free} within JOIN_TIMEOUT=3 s",
    ),
    "node-1-never-joins": (
        {**NODE_0, "MASTER_PORT": "{free2}", "JOIN_TIMEOUT": 3},
        "not all NNODES=2 nodes joined at 127.0.0.1:{free2} within JOIN_TIMEOUT=3 s",
    ),
    # A PyTorchJob's pod whose peers never come: the operator's variables, named as they are
    "pytorchjob-pod-alone": (
        {
            "PET_RDZV_ENDPOINT": "127.0.0.1:{free3}",
            "PET_NNODES": 2,
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_CONF": "join_timeout=3",
            "NPROC_PER_NODE": 1,
        },
        "not all PET_NNODES=2 nodes joined at PET_RDZV_ENDPOINT=127.0.0.1:{free3} within "
        "join_timeout=3 s (PET_RDZV_CONF): are the other pods running",
    ),
    # An elastic job's MIN:MAX (k8s/pytorchjob.yaml's 1:4): the rendezvous waits for MIN nodes
    "pytorchjob-elastic-pod-alone": (
        {
            "PET_RDZV_ENDPOINT": "127.0.0.1:{free4}",
            "PET_NNODES": "2:3",
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_CONF": "last_call_timeout=1,join_timeout=3",
            "NPROC_PER_NODE": 1,
        },
        "fewer than 2 nodes (PET_NNODES=2:3) joined at PET_RDZV_ENDPOINT=127.0.0.1:{free4} within "
        "join_timeout=3 s (PET_RDZV_CONF)",
    ),
}
LAUNCHER_VARIABLES = (
    "NPROC_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDZV_ID",
    "JOIN_TIMEOUT",
    "MAX_RESTARTS",
)


@pytest.fixture(scope="module")
def bad_launches():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        ports = {
            "busy": busy.getsockname()[1],
            "free": free_port(),
            "free2": free_port(),
            "free3": free_port(),
            "free4": free_port(),
        }
        while len(set(ports.values())) < len(ports):
            ports["free2"], ports["free3"], ports["free4"] = free_port(), free_port(), free_port()
        started = {}
        for case, (variables, _) in BAD_VARIABLES.items():
            env = launcher_env()
            # only the case's own, none from the environment the suite runs in
            for name in LAUNCHER_VARIABLES:
                env.pop(name, None)
            env.update({name: str(value).format(**ports) for name, value in variables.items()})
            # Flags for a short run, should a check ever let a case through.
            started[case] = Run(
                [
                    "bash",
                    ROOT / "run_ddp.sh",
                    "--dataset",
                    "synthetic",
                    "--max-steps",
                    "1",
                    "--no-eval",
                ],
                env=env,
            )
        yield started, ports
        for run in started.values():
            run.kill()


@pytest.mark.parametrize("case", BAD_VARIABLES)
def test_a_bad_launcher_variable_is_one_line(case, bad_launches):
    started, ports = bad_launches
    # the waiting cases take JOIN_TIMEOUT=3 s plus torchrun's start
    run = started[case].wait(timeout=60)
    assert run.returncode == 2, run.output
    assert_one_line_error(run, BAD_VARIABLES[case][1].format(**ports))
    assert "Traceback" not in run.output, run.output
    # before waiting, a node says for whom and how long
    if BAD_VARIABLES[case][0].get("JOIN_TIMEOUT") == 3:
        assert "waiting up to JOIN_TIMEOUT=3 s" in run.output, run.output


def test_more_processes_than_cores_is_a_one_line_warning():
    # The warning comes after the checks of every variable; an address that does not resolve then
    # stops the launch at once, before torch is imported (node 1 checks node 0's address first).
    cores = len(os.sched_getaffinity(0))  # as nproc counts them
    env = launcher_env(
        NPROC_PER_NODE=cores + 1, NNODES=2, NODE_RANK=1, MASTER_ADDR="no-such-host.invalid"
    )
    run = Run(["bash", ROOT / "run_ddp.sh"], env=env).wait()
    assert run.output.splitlines()[0] == (
        f"launch.sh: warning: NPROC_PER_NODE={cores + 1} processes share this node's "
        f"{cores} cores: each waits for the others (use at most {cores} for speed)"
    )
    assert_one_line_error(run, "MASTER_ADDR=no-such-host.invalid does not resolve on this node")


# How a launch ends when a worker fails or will not stop: one line from launch_torchrun.py
# (launch.sh's torchrun), never torchrun's ChildFailedError traceback. A worker that fails on
# purpose is a few lines calling the real failures.run, as a training script does; the killed and
# the stuck ones are train_ddp.py.
WORKER = """import os, signal, sys, time
import torch, torch.distributed as dist
from plumbing import failures

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        {rank_1}
    time.sleep(0.5)
    dist.barrier()  # rank 1 has gone: gloo fails here, after rank 1
    time.sleep(60)

failures.run(main)
"""
ENDINGS = {  # rank 1's line, and what the launch must print after its command line
    # rank 0 fails only because rank 1 has gone: its error is left out, rank 1's traceback is said
    # once
    "crash": (
        'raise ValueError("rank 1 went wrong")',
        [
            "Traceback (most recent call last):",
            "ValueError: rank 1 went wrong",
            "error: rank 1 (pid {pid}) on {host} failed with exit code 1: its traceback is above",
        ],
        1,
    ),
    # rank 0 never gets to say it (torchrun stops it first): the launcher prints rank 1's line from
    # its error file
    "bad-input-found-by-rank-1": (
        'raise failures.UsageError("rank 1 found a bad input")',
        ["error: rank 1 found a bad input"],
        2,
    ),
    # a CPU's bad token id (a GPU's is a device-side assert): a bug or bad data, not retried
    "index-error": (
        "torch.nn.Embedding(65, 4)(torch.tensor([70]))",
        [
            "error: IndexError: index out of range in self, at {path}:8 (main): a bug or bad data, "
            "which a retry repeats (not retried): most likely a token id outside the model's "
            "vocabulary, or a label outside its classes"
        ],
        2,
    ),
    # a signal with no handler: the launch keeps its exit code, 128 + 15
    "killed-by-sigterm": (
        "os.kill(os.getpid(), signal.SIGTERM)",
        ["error: rank 1 (pid {pid}) on {host} was killed by SIGTERM"],
        143,
    ),
}


# The README's 8 minutes: two endings there, two in CI's slow stage
SLOW_ENDINGS = {"index-error", "killed-by-sigterm"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW_ENDINGS)) for c in ENDINGS]
)
def test_a_failing_worker_is_said_once_in_its_own_words(case, tmp_path):
    rank_1, expected, exit_code = ENDINGS[case]
    (tmp_path / "worker.py").write_text(WORKER.format(rank_1=rank_1))
    run = Run(
        ["bash", ROOT / "launch.sh", tmp_path / "worker.py"], env=launcher_env(NPROC_PER_NODE=2)
    ).wait(timeout=90)
    lines = our_lines(run.output)
    pid = lines[-1].split("(pid ")[1].split(")")[0] if "(pid " in lines[-1] else "?"
    host, path = socket.gethostname(), tmp_path / "worker.py"
    said = [line.format(pid=pid, host=host, path=path) for line in expected]
    assert run.returncode == exit_code and lines[-1] == said[-1], run.output
    assert [line for line in lines if line in said] == said, run.output  # each once, in order
    # rank 0's: left out
    assert "ChildFailedError" not in run.output and "Connection" not in run.output, run.output
    assert len(lines) < 12, run.output


RETRIED = """import os
import torch.distributed as dist
from plumbing import failures

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise OSError(5, "Input/output error")  # a passing fault: exit code 75
    dist.barrier()
    print(f"rank {dist.get_rank()} done", flush=True)

failures.run(main)
"""


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_restart_says_why_from_the_failed_attempts_note(tmp_path):
    """Rank 1's I/O error on the first attempt: torchrun restarts (MAX_RESTARTS=2), and one line
    before it names the rank, its failure (its note's) and the attempts; the second passes."""
    (tmp_path / "worker.py").write_text(RETRIED)
    run = Run(
        ["bash", ROOT / "launch.sh", tmp_path / "worker.py"],
        env=launcher_env(NPROC_PER_NODE=2, MAX_RESTARTS=2),
    ).wait(timeout=120)
    restart = re.search(
        r"^attempt 1 of 3 failed: rank 1 \(pid \d+\) on \S+: OSError: \[Errno 5\] Input/output "
        r"error; torchrun restarts the workers \(attempt 2 of 3\)$",
        run.output,
        re.MULTILINE,
    )
    assert run.returncode == 0 and restart, run.output
    assert "rank 0 done" in run.output and "rank 1 done" in run.output, run.output
    assert "attempt 2 of 3 failed" not in run.output and "Traceback" not in run.output


def test_a_killed_rank_is_one_line(mnist_dir):
    run = Run(
        ["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), "--epochs", "50", "--log-every", "1"],
        env=launcher_env(NPROC_PER_NODE=2),
    )
    run.wait_for_text("step 2/")
    # bash execs torchrun: the launch is its process
    os.kill(worker_pids(run.process.pid)[1], signal.SIGKILL)
    run.wait(timeout=60)
    last = run.output.splitlines()[-1]
    assert (
        run.returncode == 128 + signal.SIGKILL
        and last.startswith("error: rank 1 (pid ")
        and last.endswith("was killed by SIGKILL: out of memory? the kernel's log (dmesg) says")
    ), run.output
    assert "Traceback" not in run.output and "[rank" not in run.output, run.output


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_stop_signal_to_one_worker_alone_stops_every_rank_and_keeps_its_exit_code(
    mnist_dir, tmp_path
):
    """SIGTERM to rank 1 alone (a per-process watchdog, a kill by hand), not to the launcher: both
    ranks stop at one step with a checkpoint, and the launch ends with rank 1's 143 and rank 0's one
    line. The old launcher took torch's placeholder error data for a note: a stray <NONE> line,
    "failed with exit code 143: its traceback is above" with none above, and exit code 1."""
    run = Run(
        [
            "bash",
            ROOT / "run_ddp.sh",
            *mnist_args(mnist_dir),
            "--epochs",
            "50",
            "--log-every",
            "1000",
            "--checkpoint-dir",
            tmp_path / "ck",
        ],
        env=launcher_env(NPROC_PER_NODE=2),
    )
    run.wait_for_text("DDP on 2 rank(s)")
    os.kill(worker_pids(run.process.pid)[1], signal.SIGTERM)
    run.wait(timeout=90)
    lines = our_lines(run.output)
    stop = re.fullmatch(
        rf"stopped by SIGTERM at step (\d+) of \d+: checkpoint step-(\d+) is in {tmp_path}/ck; "
        "the same command resumes there",
        lines[-1],
    )
    assert run.returncode == 143 and stop and stop.group(1) == stop.group(2), run.output
    assert (tmp_path / "ck" / f"step-{stop.group(1)}" / "checkpoint.json").exists()
    assert "<NONE>" not in run.output and "error" not in run.output, run.output
    # the start line, the stop's step line, the stop line
    assert len([line for line in lines if not line.startswith("step ")]) == 2, run.output


@pytest.mark.parametrize("signals", [1, pytest.param(2, marks=pytest.mark.slow)])  # 8 minutes
def test_a_stop_that_cannot_reach_a_stuck_rank_says_so(signals, mnist_dir):
    # Rank 1 stops (SIGSTOP), so rank 0 waits for it in a collective and neither can reach a
    # checkpoint: torchrun kills both after its shutdown timeout (3 s here, from torch 2.10; 30 s
    # before), or at once on a second signal. with 2 signals, the second surely comes while torchrun
    # waits, after STOP_GRACE (within it, it is the same stop): a second Ctrl-C, SIGINT
    timeout = 3 if signals == 1 else 300
    run = Run(
        ["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), "--epochs", "50", "--log-every", "1"],
        env=launcher_env(NPROC_PER_NODE=2, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=timeout),
    )
    run.wait_for_text("step 2/")
    launcher = run.process.pid
    workers = worker_pids(launcher)
    os.kill(workers[1], signal.SIGSTOP)
    wait_until(lambda: stopped(workers[1]), "rank 1 stopped", run)
    number = signal.SIGTERM if signals == 1 else signal.SIGINT
    os.kill(launcher, number)
    if signals == 2:  # torchrun passed the first on: it is pending at the stopped rank 1
        wait_until(
            lambda: in_mask(workers[1], "ShdPnd", number),
            f"torchrun's {number.name} pending at rank 1",
            run,
        )
        time.sleep(failures.STOP_GRACE + 0.5)
        os.kill(launcher, number)
    run.wait(timeout=150)  # torch 2.9's 30 s, and the kill's cleanup on a loaded machine
    lines = run.output.splitlines()
    assert run.returncode == 128 + number, run.output
    # (without the second signal, the launch would have waited 300 s: run.wait's 150 s would fail)
    if signals == 2:
        assert lines[-1] == (
            f"SIGINT again: ending now, without waiting for rank 0 (pid {workers[0]}), rank 1 "
            f"(pid {workers[1]}) to stop"
        ), run.output
    else:
        assert f"error: rank 1 (pid {workers[1]}) did not stop within" in run.output, run.output
        assert (
            "s of SIGTERM: stuck in a collective, or stopped? killing it; it wrote no checkpoint"
            in run.output
        )
    assert "Traceback" not in run.output and not [
        line for line in lines if line.startswith(("W1", "E1"))
    ]
    # the kernel kills them as the launcher dies (PR_SET_PDEATHSIG): soon after
    deadline = time.monotonic() + 10
    while (alive(workers[0]) or alive(workers[1])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(workers[0]) and not alive(workers[1])


def stopped(pid):  # state T: stopped by a signal
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize(
    "sender",
    [
        pytest.param("gnu-timeout", marks=pytest.mark.slow),  # 22 s: the suite's budget
        pytest.param("launcher-and-workers", marks=pytest.mark.slow),  # 30 s: the suite's budget
        "twice-in-the-grace",
    ],
)
def test_one_preemption_signalled_to_several_processes_is_one_stop(sender, tmp_path):
    """GNU timeout passes a SIGTERM to its child and then to the child's process group (the
    launcher gets it twice); scancel and a pod's deletion signal the launcher and the workers at
    once (each worker gets it from them and from torchrun). Two copies that arrive while one is
    pending merge into one, so those two may not deliver twice: the third case sends the launcher
    a second copy 0.5 s after the first, while the ranks stop (the old launcher ended there, with
    no checkpoint). Each is one stop: the stop checkpoint written, exit code 143, and no "SIGTERM
    again"."""
    command = ["bash", ROOT / "run_ddp.sh", "--batch-size", "16", "--max-steps", "5000"]
    command += ["--log-every", "100000", "--checkpoint-every", "20", "--no-eval"]
    command += ["--checkpoint-dir", tmp_path / "ck"]
    if sender == "gnu-timeout":  # its own limit far away: the SIGTERM below is what it passes on
        command = ["timeout", "600", *command]
    run = Run(command, env=launcher_env(NPROC_PER_NODE=2))
    wait_for(tmp_path / "ck" / "step-20", run)
    if sender == "gnu-timeout":
        os.kill(run.process.pid, signal.SIGTERM)
    elif sender == "launcher-and-workers":
        for pid in [run.process.pid, *worker_pids(run.process.pid).values()]:
            os.kill(pid, signal.SIGTERM)
    else:
        os.kill(run.process.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(run.process.pid, signal.SIGTERM)
        # and until it exits, a copy is the launcher's to take: Python's exit puts the default
        # handlers back, then unloads torch for seconds (a copy there ended it by SIGTERM, -15)
        while run.process.poll() is None:
            caught = in_mask(run.process.pid, "SigCgt", signal.SIGTERM)
            assert caught or not alive(run.process.pid), "SIGTERM's default, the launcher alive"
            time.sleep(0.01)
    run.wait()
    stop = re.search(
        r"stopped by SIGTERM at step (\d+) of \d+: checkpoint step-(\d+) is in", run.output
    )
    assert run.returncode == 143 and stop and stop.group(1) == stop.group(2), run.output
    assert (tmp_path / "ck" / f"step-{stop.group(1)}" / "checkpoint.json").exists()
    assert "again" not in run.output, run.output
