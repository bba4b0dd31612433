"""Beyond one node: slurm/train.sbatch and k8s/ run here as far as one machine allows, and stops on
signals.

SLURM's srun and scontrol are stand-ins (tests/stand_ins/) that start each "node" on this machine;
the PyTorchJob's container command runs as two "pods" with the variables the Training Operator would
set. Each run is stopped by a real signal mid-run, as the scheduler would send it, and run again: it
must resume and end with the weights of a run never stopped, on one node.
"""

import os
import re
import shlex
import shutil
import signal

import pytest
import yaml
from conftest import (
    ROOT,
    Run,
    alive,
    descendants,
    free_port,
    launcher_env,
    load_weights,
    max_difference,
    mnist_args,
    succeeded,
    wait_for,
)

STAND_INS = ROOT / "tests" / "stand_ins"
# 40 steps (2 epochs of 20 at global batch 32), a loss reading (and a chance to stop) every 2 steps.
RUN = [
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--epochs",
    "5",
    "--max-steps",
    "40",
    "--batch-size",
    "16",
    "--log-every",
    "2",
    "--checkpoint-every",
    "10",
]
STOPPED = re.compile(
    r"stopped by (SIG\w+) at step (\d+) of 40: checkpoint step-\2 is in (\S+); the same command"
)


@pytest.fixture(scope="module")
def last_step_stop(mnist_dir, tmp_path_factory):
    """run_ddp.sh on one node, 2 processes, sent SIGTERM once it logged its last step: (command,
    run, directory)."""
    directory = tmp_path_factory.mktemp("last-step-stop")
    job = [
        "bash",
        ROOT / "run_ddp.sh",
        *mnist_args(mnist_dir),
        *RUN,
        "--checkpoint-every",
        "100",
        "--checkpoint-dir",
        directory / "ck",
        "--save",
        directory / "final.pt",
    ]
    run = Run(job, env=launcher_env(NPROC_PER_NODE=2))
    run.wait_for_text("step 40/40")
    _signal(run.process.pid, signal.SIGTERM)  # bash execs torchrun: the launch is its process
    return job, run.wait(), directory


@pytest.fixture(scope="module")
def never_stopped(last_step_stop):
    """Final weights of train_ddp.py on one node, 2 processes, never stopped before its end: the run
    above (a signal after the last step lets it finish; the test below checks that)."""
    _, run, directory = last_step_stop
    assert run.returncode == 0, run.output[-3000:]
    return load_weights(directory / "final.pt")


def assert_stopped(run, signal_name, checkpoint_dir):
    """The run stopped on ``signal_name`` mid-run, with its exit code, at a checkpoint every rank
    wrote."""
    assert run.returncode == 128 + signal.Signals[signal_name], (
        f"exit code {run.returncode}:\n{run.output[-3000:]}"
    )
    stops = STOPPED.findall(run.output)
    assert len(stops) == 1, run.output[-3000:]  # one line, from rank 0
    name, step, directory = stops[0]
    assert name == signal_name and 10 <= int(step) < 40, (
        stops
    )  # after the first checkpoint, before the end
    assert (checkpoint_dir / f"step-{step}" / "checkpoint.json").exists()
    assert "Traceback" not in run.output, run.output[-3000:]
    return int(step)


@pytest.mark.slow  # as the Kubernetes pods below (pytest.ini)
def test_slurm_two_nodes_stop_before_the_time_limit_requeue_and_end_like_one_node(
    never_stopped, mnist_dir, tmp_path
):
    requeued, srun_options = tmp_path / "scontrol.log", tmp_path / "srun.log"
    env = launcher_env(
        # What SLURM sets in the batch script of a 2-node job (the hosts: both this machine), the
        # CPUs from its #SBATCH --cpus-per-task.
        SLURM_JOB_ID=4242,
        SLURM_JOB_NAME="babycnn",
        SLURM_JOB_NUM_NODES=2,
        SLURM_JOB_NODELIST="127.0.0.1,localhost",
        SLURM_CPUS_PER_TASK=32,
        SLURM_SUBMIT_DIR=ROOT,
        SCONTROL_LOG=requeued,
        SRUN_LOG=srun_options,
        NPROC_PER_NODE=1,
        MASTER_PORT=free_port(),
        CHECKPOINT_DIR=tmp_path / "ck",  # a CPU "node": 1 process
    )
    env["PATH"] = f"{STAND_INS}{os.pathsep}{env['PATH']}"
    job = [
        "bash",
        ROOT / "slurm" / "train.sbatch",
        "ddp",
        *mnist_args(mnist_dir),
        *RUN,
        "--save",
        tmp_path / "final.pt",
    ]
    first = Run(job, env=env)
    wait_for(tmp_path / "ck" / "step-10", first)
    # --signal=USR1@180: SLURM signals every process of the job's steps (each node's torchrun and
    # workers), not srun nor the batch script.
    srun = next(
        pid for pid in descendants(first.process.pid) if b"stand_ins/srun" in _command_line(pid)
    )
    for pid in descendants(srun):
        _signal(pid, signal.SIGUSR1)
    first.wait()
    step = assert_stopped(first, "SIGUSR1", tmp_path / "ck")
    assert (
        requeued.read_text() == "requeue 4242\n"
    )  # the batch script asked SLURM to run the job again
    assert not (tmp_path / "final.pt").exists()

    second = succeeded(
        Run(job, env={**env, "SLURM_RESTART_COUNT": "1"})
    )  # the requeued job: same id, same command
    assert f"resumed from {tmp_path / 'ck'}/step-{step} (step {step}," in second.output
    assert "2 node(s), node 0 127.0.0.1" in second.output and "DDP on 2 rank(s)" in second.output
    assert requeued.read_text() == "requeue 4242\n"  # a job that finished is not requeued
    assert max_difference(load_weights(tmp_path / "final.pt"), never_stopped) == 0
    # Each job's srun asks for the job's CPUs per task: since Slurm 22.05 it does not inherit them
    # from #SBATCH.
    assert srun_options.read_text() == "--cpus-per-task=32\n" * 2


@pytest.mark.parametrize(
    "strategy, error",
    [
        (
            "ddpp",
            "error: the first argument is the strategy, ddp, fsdp, pippy or tp, got 'ddpp' "
            "(e.g. sbatch slurm/train.sbatch ddp --epochs 3)",
        ),
        (
            "fsdp",
            "error: SLURM_JOB_ID is not set: submit this with sbatch (sbatch slurm/train.sbatch "
            "fsdp ...), "
            "or on one machine use bash run_fsdp.sh",
        ),
    ],
)
def test_the_batch_script_refuses_in_one_line(strategy, error):
    env = launcher_env()
    env.pop("SLURM_JOB_ID", None)  # not inside a SLURM job, even when the suite runs in one
    run = Run(["bash", ROOT / "slurm" / "train.sbatch", strategy, "--epochs", "1"], env=env).wait()
    assert run.returncode == 2
    assert run.output.strip() == error


def test_a_stop_after_the_last_step_leaves_a_finished_run_that_a_requeued_job_finds_done(
    last_step_stop, never_stopped
):
    # A scheduler's signal may come while the run evaluates and saves: it finishes, writes the last
    # step's checkpoint and exits 0, so SLURM does not requeue it; a job run again all the same only
    # loads that checkpoint and saves.
    job, first, directory = last_step_stop
    assert first.returncode == 0, first.output[-3000:]
    assert sorted(p.name for p in (directory / "ck").iterdir()) == [
        "step-40"
    ]  # the last step's, none every 100
    again = succeeded(Run(job, env=launcher_env(NPROC_PER_NODE=2)))
    assert f"resumed from {directory / 'ck'}/step-40 (step 40," in again.output, again.output
    assert not re.search(r"^step \d+/40:", again.output, re.M), (
        again.output
    )  # no step trained again
    assert max_difference(load_weights(directory / "final.pt"), never_stopped) == 0


# ---- Kubernetes
# ----------------------------------------------------------------------------------------------

MANIFEST = ROOT / "k8s" / "pytorchjob.yaml"


def worker_spec():
    job = yaml.safe_load(MANIFEST.read_text())
    return job, job["spec"]["pytorchReplicaSpecs"]["Worker"]


def test_the_pytorchjob_is_what_the_training_operator_needs():
    job, worker = worker_spec()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]  # elastic: no Master replica
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d"
    assert 1 <= elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert elastic["maxRestarts"] >= 1
    # ExitCode: 128-255 (a signal) restarts the pod, 1-127 fails it; our stop codes and usage errors
    # fall on each side.
    assert worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    assert (
        pod["terminationGracePeriodSeconds"] > 30
    )  # torchrun waits 30 s for the workers' checkpoint
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator finds its container by this name
    assert container["command"][:2] == ["bash", "launch.sh"]
    assert container["command"][2] in (
        "train_ddp.py",
        "train_fsdp.py",
        "train_pippy.py",
        "train_tp.py",
    )
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert (
        "persistentVolumeClaim"
        in volumes[next(n for n, path in mounts.items() if path == "/shared")]
    )
    flags = dict(
        flag.removeprefix("--").split("=", 1) for flag in container["command"][3:] if "=" in flag
    )
    for flag in (
        "data-dir",
        "checkpoint-dir",
        "save",
    ):  # on the shared volume, where every pod sees them
        assert flags[flag].startswith("/shared/"), flag


def image_workdir(tmp_path):
    """The files k8s/Dockerfile copies into its WORKDIR, copied the same way into a directory
    here."""
    workdir = tmp_path / "image"
    workdir.mkdir()
    lines = (ROOT / "k8s" / "Dockerfile").read_text().splitlines()
    assert any(
        line.startswith("FROM pytorch/pytorch:") for line in lines
    )  # an official PyTorch image
    for line in lines:
        if line.startswith("COPY "):
            *sources, destination = shlex.split(line)[1:]
            for source in sources:
                if source.endswith("/"):  # a directory: its contents into the destination directory
                    shutil.copytree(ROOT / source, workdir / destination)
                else:
                    # a file: into the destination directory ("./", "models/") or onto the path
                    # given
                    target = workdir / destination
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(
                        ROOT / source, target / source if destination.endswith("/") else target
                    )
    return workdir


@pytest.mark.slow
def test_the_container_command_runs_as_two_elastic_pods_stops_on_sigterm_and_resumes(
    never_stopped, mnist_dir, tmp_path
):
    job, worker = worker_spec()
    (container,) = worker["template"]["spec"]["containers"]
    elastic = job["spec"]["elasticPolicy"]
    workdir = image_workdir(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    # The manifest's command, its /shared paths on a directory here, then this test's short run
    # (later flags win).
    command = [word.replace("=/shared/", f"={shared}/") for word in container["command"]]
    command += [*mnist_args(mnist_dir), *RUN]
    port = free_port()

    def pods():
        runs = []
        for _ in range(worker["replicas"]):
            env = launcher_env(
                # What the operator sets in each pod of an elastic PyTorchJob (the first pod's
                # service: this machine).
                PET_RDZV_BACKEND=elastic["rdzvBackend"],
                PET_RDZV_ENDPOINT=f"localhost:{port}",
                PET_NNODES=f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
                PET_MAX_RESTARTS=elastic["maxRestarts"],
                PET_RDZV_ID=f"test-{port}",
                NPROC_PER_NODE=1,  # a CPU "pod": 1 process (launch.sh would count the pod's GPUs)
                # The rendezvous closes when maxReplicas joined, or this long after minReplicas did.
                PET_RDZV_CONF="last_call_timeout=5",
            )
            env.pop("PYTHONPATH")  # only what the image holds
            runs.append(Run(command, env=env, cwd=workdir))
        return runs

    first = pods()
    checkpoints = shared / "checkpoints" / "babycnn-ddp"
    wait_for(checkpoints / "step-10", *first)
    for pod in (
        first
    ):  # `kubectl delete` or a drained node: the kubelet sends SIGTERM to the container's PID 1
        _signal(
            pod.process.pid, signal.SIGTERM
        )  # launch.sh exec'd torchrun: the pod's first process
    stopped = [pod.wait() for pod in first]
    assert sorted(pod.returncode for pod in stopped) == [143, 143], [
        pod.output[-2000:] for pod in stopped
    ]
    step = assert_stopped(
        next(pod for pod in stopped if STOPPED.search(pod.output)), "SIGTERM", checkpoints
    )

    second = [
        succeeded(pod) for pod in pods()
    ]  # restartPolicy ExitCode: 143 is retried, the pods come back
    assert any(f"resumed from {checkpoints}/step-{step}" in pod.output for pod in second)
    assert max_difference(load_weights(shared / "babycnn-ddp.pt"), never_stopped) == 0


# ---- Ctrl-C
# --------------------------------------------------------------------------------------------------


# DDP stops in the tests above; the other scripts' stops (every pipeline stage, every tp group must
# agree) here.
@pytest.mark.parametrize(
    "launcher",  # the pipeline's and TP's in CI's slow stage, for the README's 8 minutes
    [
        "run_fsdp.sh",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("run_pippy.sh", "run_tp.sh")),
    ],
)
def test_ctrl_c_stops_every_process_at_a_checkpoint(launcher, mnist_dir, tmp_path):
    run = Run(
        [
            "bash",
            ROOT / launcher,
            *mnist_args(mnist_dir),
            *RUN,
            "--checkpoint-dir",
            tmp_path / "ck",
        ],
        env=launcher_env(NPROC_PER_NODE=2),
    )
    wait_for(tmp_path / "ck" / "step-10", run)
    processes = descendants(run.process.pid)
    os.killpg(
        run.process.pid, signal.SIGINT
    )  # what a terminal does on Ctrl-C: the foreground process group
    run.wait()
    assert_stopped(run, "SIGINT", tmp_path / "ck")
    assert [pid for pid in processes if alive(pid)] == []  # nothing left behind


def _signal(pid, number):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_image_pins_the_torch_release_ci_tests_as_the_floor():
    image = re.search(
        r"^FROM pytorch/pytorch:([\d.]+)-", (ROOT / "k8s" / "Dockerfile").read_text(), re.M
    ).group(1)
    floor = re.search(
        r"pip install --quiet --no-cache-dir torch==([\d.]+) ", (ROOT / ".ci" / "run").read_text()
    ).group(1)
    assert image == floor == "2.9.1"
