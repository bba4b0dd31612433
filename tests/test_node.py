"""The multi-GPU node by the book (issue 60): one rank's error ends the job at once, the default
commands fit the node, NCCL's failures named for what they are. Each decision is a function called
here; gloo runs show what gloo can; tests/test_gpu.py holds the NCCL runs for 2+ GPUs."""

import socket

import pytest
from conftest import ROOT, Run, launcher_env, our_lines

from plumbing import failures

ALONE = """import os, time
import torch, torch.distributed as dist
from plumbing import failures

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        # as DDP's bucket during backward: a collective rank 0 has not joined yet
        dist.all_reduce(torch.ones(1000), async_op=True)
        raise OSError(5, "Input/output error")  # rank 1's own error: exit code 75
    time.sleep(120)  # a slow step: rank 0 would join that all-reduce only later

failures.run(main)
"""


def test_one_ranks_own_error_ends_the_job_within_seconds_with_its_line(tmp_path):
    """Rank 1 raises alone with a collective in flight: the old end destroyed the process group,
    which waits for that collective (gloo joins its threads; NCCL flushes the communicator), so
    the job hung until rank 0 woke (2 minutes here, the watchdog's 10 on NCCL). Now rank 1 exits
    at once with its line and exit code, and torchrun's signal ends rank 0."""
    (tmp_path / "worker.py").write_text(ALONE)
    run = Run(
        ["bash", ROOT / "launch.sh", tmp_path / "worker.py"], env=launcher_env(NPROC_PER_NODE=2)
    ).wait(timeout=100)
    lines = our_lines(run.output)
    assert run.returncode == failures.RETRY_EXIT, run.output
    assert lines[-1].startswith("error: OSError: [Errno 5] Input/output error; it may pass on a")
    assert run.seconds < 60, f"{run.seconds:.0f} s:\n{run.output}"  # torch's import included
    assert "Traceback" not in run.output and socket.gethostname() not in lines[-1], run.output


@pytest.mark.parametrize(
    "problem, world_size, destroys",
    [
        (None, 2, True),  # main returned on every rank
        (failures.Stopped("stopped by SIGTERM", 143), 8, True),  # the ranks agreed to stop
        (failures.UsageError("bad input"), 2, False),  # one rank may have found it alone
        (OSError(5, "Input/output error"), 2, False),
        (RuntimeError("a crash"), 2, False),
        (KeyboardInterrupt(), 2, False),
        (RuntimeError("a crash"), 1, True),  # no peer to wait for
    ],
)
def test_the_process_group_is_destroyed_only_where_the_ranks_end_together(
    problem, world_size, destroys
):
    assert failures.ends_together(problem, world_size) is destroys
