"""launch.sh (behind every run_*.sh): how many processes it starts, and what it refuses."""

import os
import socket

import pytest

from conftest import ROOT, Run, assert_one_line_error, free_port, launcher_env, mnist_args, succeeded


def test_the_process_count_is_the_gpus_torch_sees_not_those_nvidia_smi_lists(mnist_dir, tmp_path):
    # nvidia-smi lists every GPU of the machine, also those CUDA_VISIBLE_DEVICES hides (here: all of them).
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    (fake / "nvidia-smi").chmod(0o755)
    env = launcher_env()
    env.pop("NPROC_PER_NODE", None)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    run = succeeded(Run(["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), "--max-steps", "1", "--no-eval"],
                        env=env))
    assert "DDP on 2 rank(s)" in run.output  # no GPU for torch: 2 CPU processes, not 8


# Bad launcher variables, every case in one table: (environment, the error line it must give). {busy} is a port
# something listens on, {free} and {free2} ports nobody does. The waiting cases wait JOIN_TIMEOUT=3 s.
NODE_1 = {"NNODES": 2, "NODE_RANK": 1, "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": 1}
NODE_0 = {**NODE_1, "NODE_RANK": 0}
BAD_VARIABLES = {
    "nproc-0": ({"NPROC_PER_NODE": 0}, "NPROC_PER_NODE must be a positive integer (processes on this node), got '0'"),
    "nproc-word": ({"NPROC_PER_NODE": "abc"},
                   "NPROC_PER_NODE must be a positive integer (processes on this node), got 'abc'"),
    "nnodes-0": ({"NNODES": 0}, "NNODES must be a positive integer (the number of nodes), got '0'"),
    "node-rank-past-nnodes": ({**NODE_1, "NODE_RANK": 2}, "NODE_RANK must be 0 to 1 with NNODES=2, got '2'"),
    "node-rank-negative": ({"NODE_RANK": -1}, "NODE_RANK must be 0 to 0 with NNODES=1, got '-1'"),
    "master-port-0": ({"MASTER_PORT": 0}, "MASTER_PORT must be a port number, 1 to 65535, got '0'"),
    "master-port-70000": ({"MASTER_PORT": 70000}, "MASTER_PORT must be a port number, 1 to 65535, got '70000'"),
    "max-restarts-negative": ({"MAX_RESTARTS": -1}, "MAX_RESTARTS must be an integer, 0 or more, got '-1'"),
    "join-timeout-0": ({"JOIN_TIMEOUT": 0}, "JOIN_TIMEOUT must be a positive integer (seconds), got '0'"),
    "no-master-addr": ({"NNODES": 2, "NODE_RANK": 1}, "NNODES=2 needs MASTER_ADDR, node 0's address"),
    # several nodes: what torchrun reports in a 40- to 80-line traceback, or after 10 silent minutes
    "master-port-in-use": ({**NODE_0, "MASTER_PORT": "{busy}"},
                           "node 0 cannot listen on MASTER_PORT={busy} (Address already in use): pick another"),
    "master-addr-unresolvable": ({**NODE_1, "MASTER_ADDR": "no-such-host.invalid"},
                                 "MASTER_ADDR=no-such-host.invalid does not resolve on this node"),
    "node-0-never-answers": ({**NODE_1, "MASTER_PORT": "{free}", "JOIN_TIMEOUT": 3},
                             "nothing answered at MASTER_ADDR:MASTER_PORT=127.0.0.1:{free} within JOIN_TIMEOUT=3 s"),
    "node-1-never-joins": ({**NODE_0, "MASTER_PORT": "{free2}", "JOIN_TIMEOUT": 3},
                           "not all NNODES=2 nodes joined at 127.0.0.1:{free2} within JOIN_TIMEOUT=3 s"),
}
LAUNCHER_VARIABLES = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "JOIN_TIMEOUT",
                      "MAX_RESTARTS")


@pytest.fixture(scope="module")
def bad_launches():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        ports = {"busy": busy.getsockname()[1], "free": free_port(), "free2": free_port()}
        while ports["free2"] == ports["free"]:
            ports["free2"] = free_port()
        started = {}
        for case, (variables, _) in BAD_VARIABLES.items():
            env = launcher_env()
            for name in LAUNCHER_VARIABLES:  # only the case's own, none from the environment the suite runs in
                env.pop(name, None)
            env.update({name: str(value).format(**ports) for name, value in variables.items()})
            # Flags for a short run, should a check ever let a case through.
            started[case] = Run(["bash", ROOT / "run_ddp.sh", "--dataset", "synthetic", "--max-steps", "1",
                                 "--no-eval"], env=env)
        yield started, ports
        for run in started.values():
            run.kill()


@pytest.mark.parametrize("case", BAD_VARIABLES)
def test_a_bad_launcher_variable_is_one_line(case, bad_launches):
    started, ports = bad_launches
    run = started[case].wait(timeout=60)  # the waiting cases take JOIN_TIMEOUT=3 s plus torchrun's start
    assert run.returncode == 2, run.output
    assert_one_line_error(run, BAD_VARIABLES[case][1].format(**ports))
    assert "Traceback" not in run.output, run.output
    if BAD_VARIABLES[case][0].get("JOIN_TIMEOUT") == 3:  # before waiting, a node says for whom and how long
        assert "waiting up to JOIN_TIMEOUT=3 s" in run.output, run.output
