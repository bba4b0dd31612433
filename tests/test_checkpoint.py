"""Checkpoint, resume and fault tolerance, with real kills, for all three scripts."""

import csv
import json
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    ROOT,
    Run,
    alive,
    assert_one_line_error,
    launch,
    launcher_env,
    load_weights,
    max_difference,
    mnist_args,
    python,
    succeeded,
    torchrun,
    wait_for,
    worker_pids,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_bad_input import bound_by_permissions

# 40 fp32 steps over 2 epochs (20 steps each at global batch 32), a checkpoint every 10 steps.
LONG = [
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--epochs",
    "5",
    "--max-steps",
    "40",
    "--log-every",
    "10",
    "--checkpoint-every",
    "10",
]
SCRIPTS = {  # name: (launcher, script, flags)
    "ddp": ("run_ddp.sh", "train_ddp.py", ["--batch-size", "16"]),
    "fsdp": ("run_fsdp.sh", "train_fsdp.py", ["--batch-size", "16"]),
    "pippy": ("run_pippy.sh", "train_pippy.py", ["--batch-size", "32"]),
    "tp": ("run_tp.sh", "train_tp.py", ["--batch-size", "32"]),  # one group of 2 tp ranks
}


# FSDP's uninterrupted run recomputes activations: every run compared with it (the killed one, each
# resume of its checkpoints) goes without, so --activation-checkpointing must change no bit and no
# parameter name.
RECOMPUTE = {"fsdp": ["--activation-checkpointing"]}


@pytest.fixture(scope="module")
def uninterrupted(mnist_dir, tmp_path_factory):
    """uninterrupted(name): directory of a 2-rank run of that script, never stopped: final.pt and
    ck/."""
    done = {}

    def get(name):
        if name not in done:
            directory = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            _, script, flags = SCRIPTS[name]
            run = succeeded(
                torchrun(
                    script,
                    2,
                    *mnist_args(mnist_dir),
                    *LONG,
                    *flags,
                    *RECOMPUTE.get(name, []),
                    "--checkpoint-dir",
                    directory / "ck",
                    "--save",
                    directory / "final.pt",
                    "--log-dir",
                    directory / "log",
                )
            )
            assert name != "fsdp" or "FSDP (full, activation checkpointing," in run.output, (
                run.output
            )
            done[name] = directory
        return done[name]

    return get


# DDP's resume is the stopped job's below; torchrun's restart is the same for the three scripts.
# FSDP's killed run reads its batches through a DataLoader with 2 workers per rank (--workers 2), as
# a Dataset of your own is read, and is killed halfway through its first epoch: after the restart it
# must read on with the very samples, in the order, that the uninterrupted run (on-device batches)
# read. (name: flags, the checkpoint to wait for before the kill.)
KILLED = {"fsdp": (["--workers", "2"], "step-10"), "pippy": ([], "step-20"), "tp": ([], "step-20")}


@pytest.mark.parametrize(
    "name", ["fsdp", *(pytest.param(n, marks=pytest.mark.slow) for n in ("pippy", "tp"))]
)
def test_a_killed_rank_is_restarted_and_the_job_ends_as_if_never_interrupted(
    name, uninterrupted, mnist_dir, tmp_path
):
    (launcher, _, flags), (more, step) = SCRIPTS[name], KILLED[name]
    args = [
        "bash",
        ROOT / launcher,
        *mnist_args(mnist_dir),
        *LONG,
        *flags,
        *more,
        "--checkpoint-dir",
        tmp_path / "ck",
        "--save",
        tmp_path / "final.pt",
        "--log-dir",
        tmp_path / "log",
    ]
    run = Run(args, env=launcher_env(NPROC_PER_NODE=2, MAX_RESTARTS=1))
    wait_for(tmp_path / "ck" / step, run)
    os.kill(worker_pids(run.process.pid)[1], signal.SIGKILL)  # rank 1 dies mid-run
    succeeded(run)
    resumed = [line for line in run.output.splitlines() if "resumed from" in line]
    assert resumed, run.output  # torchrun restarted the workers, which resumed
    assert name != "fsdp" or "/ck/step-20 " not in resumed[0], resumed  # mid-epoch: step 10 (or 30)
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(uninterrupted(name) / "final.pt")
        )
        == 0
    )
    # --log-dir's rows go on where the checkpoint was: each logging step and evaluation once, with
    # the same numbers
    rows, never_stopped = (
        metrics_rows(directory / "log" / "metrics.csv")
        for directory in (tmp_path, uninterrupted(name))
    )
    assert rows == never_stopped and any(row["test_loss"] for row in rows), rows
    steps = [int(row["step"]) for row in rows if row["train_loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == 40, steps
    # and TensorBoard's events: the resumed run's purge those after its checkpoint, so each step is
    # read once
    events = EventAccumulator(str(tmp_path / "log"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [
        (int(row["step"]), pytest.approx(float(row["train_loss"]), rel=1e-6))
        for row in rows
        if row["train_loss"]
    ]


def metrics_rows(path):
    """metrics.csv's rows, less the samples per second (a clock's reading)."""
    with open(path, newline="") as file:
        return [
            {k: v for k, v in row.items() if k != "samples_per_second"}
            for row in csv.DictReader(file)
        ]


def test_a_stopped_job_resumes_with_the_same_command(uninterrupted, mnist_dir, tmp_path):
    args = [
        *mnist_args(mnist_dir),
        *LONG,
        "--batch-size",
        "16",
        "--checkpoint-dir",
        tmp_path / "ck",
        "--save",
        tmp_path / "final.pt",
    ]
    first = torchrun("train_ddp.py", 2, *args)
    wait_for(tmp_path / "ck" / "step-30", first)
    workers = list(worker_pids(first.process.pid).values())
    os.kill(
        first.process.pid, signal.SIGKILL
    )  # torchrun alone, as the OOM killer or a scheduler's hard kill would
    first.wait()
    # The workers die with their launcher instead of training on (orphans would finish in seconds,
    # and save).
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(workers) == 2 and not any(alive(pid) for pid in workers), first.output[-2000:]
    assert not (tmp_path / "final.pt").exists()
    second = succeeded(torchrun("train_ddp.py", 2, *args))
    resumed = [line for line in second.output.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "/ck/step-" in resumed[0]
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(uninterrupted("ddp") / "final.pt")
        )
        == 0
    )


def test_every_rank_saves_the_random_state_of_each_generator_it_uses(uninterrupted):
    step = uninterrupted("ddp") / "ck" / "step-40"
    # The suite trains on CPUs; on GPUs "cuda" joins "cpu" (tests/test_gpu.py checks that). They are
    # restored on the same device type at the same world size (random states are per rank).
    assert json.loads((step / "checkpoint.json").read_text())["layout"]["device"] == "cpu"
    saved = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("rng.")} == {"rng.rank0.cpu", "rng.rank1.cpu"}


@pytest.mark.parametrize(
    "name", ["ddp", "fsdp", *(pytest.param(n, marks=pytest.mark.slow) for n in ("pippy", "tp"))]
)
def test_each_rank_draws_from_a_generator_seeded_its_own_way(name, uninterrupted, tmp_path):
    """Issue 53: every rank seeded the same generator and never reseeded, so dropout drew the same
    masks on every rank, for different samples. Once the model is built (from --seed, the same
    everywhere; FSDP's and TP's filled from it), rank r's generator is seeded with --seed + r, as
    nanoGPT's (issue 64: in each script, where it builds the model): BabyCNN draws nothing from
    it, so each rank's saved state is exactly that seed's, and the two differ (the pipeline's
    stages, TP's ranks of a group too)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(uninterrupted(name) / "ck" / "step-40", tmp_path / "step-40.pt")
    rng = torch.load(tmp_path / "step-40.pt", weights_only=True)["rng"]
    for rank in (0, 1):  # --seed 0, the default
        expected = torch.Generator().manual_seed(rank).get_state()
        assert torch.equal(rng[f"rank{rank}"]["cpu"], expected), rank
    assert not torch.equal(rng["rank0"]["cpu"], rng["rank1"]["cpu"])


def copy_checkpoints(source, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(source / "ck", target)
    return target


def test_ddp_checkpoint_resumes_on_one_process_past_an_interrupted_save(
    uninterrupted, mnist_dir, tmp_path
):
    checkpoints = copy_checkpoints(uninterrupted("ddp"), tmp_path)
    # What a crash in the middle of the next save leaves: a half-written temporary directory.
    partial = checkpoints / ".tmp-step-50"
    shutil.copytree(checkpoints / "step-40", partial)
    data_file = next(partial.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    run = succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            *LONG,
            "--batch-size",
            "32",
            "--checkpoint-dir",
            checkpoints,
            "--save",
            tmp_path / "final.pt",
        )
    )
    assert f"resumed from {checkpoints}/step-40 (step 40" in run.output
    # 40 of 40 steps were done: the run only loads (world size 2 -> 1) and saves.
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(uninterrupted("ddp") / "final.pt")
        )
        == 0
    )


@pytest.mark.parametrize(
    "saved, script, ranks, flags",
    [
        pytest.param("fsdp", "train_fsdp.py", 4, ["--batch-size", "8"], id="fsdp-2-to-fsdp-4"),
        pytest.param("fsdp", "train_ddp.py", 1, ["--batch-size", "32"], id="fsdp-to-ddp"),
        # -m slow:
        pytest.param(
            "pippy",
            "train_ddp.py",
            1,
            ["--batch-size", "32"],
            id="pipeline-to-ddp",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "pippy",
            "train_pippy.py",
            2,
            ["--batch-size", "32", "--schedule", "looped-bfs"],
            id="pipeline-2-stages-to-4",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "ddp",
            "train_fsdp.py",
            2,
            ["--batch-size", "16"],
            id="ddp-to-fsdp",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "tp", "train_ddp.py", 1, ["--batch-size", "32"], id="tp-to-ddp", marks=pytest.mark.slow
        ),
        pytest.param(
            "ddp", "train_tp.py", 2, ["--batch-size", "32"], id="ddp-to-tp", marks=pytest.mark.slow
        ),
    ],
)
def test_checkpoints_reshard_across_strategies(
    saved, script, ranks, flags, uninterrupted, mnist_dir, tmp_path
):
    # DCP stores each tensor under its parameter name: whoever wrote a part, any layout loads it.
    checkpoints = copy_checkpoints(uninterrupted(saved), tmp_path)
    run = succeeded(
        launch(
            script,
            ranks,
            *mnist_args(mnist_dir),
            *LONG,
            *flags,
            "--checkpoint-dir",
            checkpoints,
            "--save",
            tmp_path / "final.pt",
            "--metrics",
            tmp_path / "metrics.json",
        )
    )
    assert "resumed from" in run.output
    weights = load_weights(tmp_path / "final.pt")
    assert max_difference(weights, load_weights(uninterrupted(saved) / "final.pt")) == 0
    if (
        script == "train_fsdp.py" and ranks == 4
    ):  # full sharding: each rank holds its rows of every parameter only
        assert_each_rank_holds_its_rows(
            json.loads((tmp_path / "metrics.json").read_text()), weights
        )


def assert_each_rank_holds_its_rows(metrics, weights):
    """FSDP2 shards each parameter by rows, as torch.chunk does (BabyCNN's 10-row classifier:
    3/3/3/1 on 4 ranks): after the evaluation a rank holds exactly its rows of the weights and of
    SGD's momentum, 4 bytes each (no gradients: resumed at its last step, the run trained none). A
    block still gathered would add its full size."""
    ranks = len(metrics["ranks"])
    elements = [0] * ranks
    for w in weights.values():
        for rank, part in enumerate(torch.arange(len(w)).chunk(ranks)):
            elements[rank] += len(part) * (w.numel() // len(w))
    assert [r["state_bytes"] for r in metrics["ranks"]] == [8 * n for n in elements], (
        metrics["ranks"],
        elements,
    )


def test_a_resharded_resume_continues_training(uninterrupted, mnist_dir, tmp_path):
    checkpoints = copy_checkpoints(uninterrupted("fsdp"), tmp_path)
    metrics_path = tmp_path / "metrics.json"
    longer = [a if a != "40" else "80" for a in LONG]  # 40 more steps (2 epochs) than were saved
    run = succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            *longer,
            "--batch-size",
            "32",
            "--checkpoint-dir",
            checkpoints,
            "--metrics",
            metrics_path,
        )
    )
    assert "resumed from" in run.output
    metrics = json.loads(metrics_path.read_text())
    assert metrics["steps"] == 80 and metrics["loss_curve"][0][0] == 50  # counted on from step 40
    before = json.loads((uninterrupted("fsdp") / "ck" / "step-40" / "checkpoint.json").read_text())
    assert before["step"] == 40
    assert metrics["final_train_loss"] < 1.0 and metrics["test_accuracy"] > 0.5


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_resume_from_an_older_checkpoint_ends_as_the_uninterrupted_run(
    uninterrupted, mnist_dir, tmp_path
):
    checkpoints = copy_checkpoints(uninterrupted("ddp"), tmp_path)  # step-30 and step-40
    run = succeeded(
        torchrun(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *LONG,
            "--batch-size",
            "16",
            "--checkpoint-dir",
            checkpoints,
            "--resume-from",
            checkpoints / "step-30",
            "--save",
            tmp_path / "final.pt",
        )
    )
    assert f"resumed from {checkpoints}/step-30 (step 30, epoch 2)" in run.output, run.output
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(uninterrupted("ddp") / "final.pt")
        )
        == 0
    )
    # The newer step-40 moved aside, never resumed from again; this branch's own step-40 in its
    # place
    assert (
        f"--resume-from {checkpoints}/step-30: the newer step-40 moved aside to abandoned-step-<N>"
        in run.output
    )
    assert sorted(os.listdir(checkpoints)) == [
        "abandoned-step-40",
        "history.json",  # what --keep-checkpoints pruned: step-10, step-20
        "step-30",
        "step-40",
    ]
    # The same command again (a requeued job keeps its flags): it goes on from its branch, not back
    # to step 30
    again = succeeded(
        torchrun(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *LONG,
            "--batch-size",
            "16",
            "--checkpoint-dir",
            checkpoints,
            "--resume-from",
            checkpoints / "step-30",
        )
    )
    assert f"was applied before: its branch goes on from {checkpoints}/step-40" in again.output, (
        again.output
    )
    assert f"resumed from {checkpoints}/step-40 (step 40," in again.output, again.output


def test_a_damaged_checkpoint_is_set_aside_and_the_newest_intact_one_resumes(
    uninterrupted, mnist_dir, tmp_path
):
    checkpoints = copy_checkpoints(uninterrupted("ddp"), tmp_path)
    data_file = next((checkpoints / "step-40").glob("*.distcp"))
    damaged = bytearray(data_file.read_bytes())
    damaged[2000:3024] = bytes(
        1024
    )  # 1 KiB overwritten in place, the size unchanged: DCP alone would load it
    data_file.write_bytes(damaged)
    # 2 ranks (rank 0 checks the files); 2 x 24 is another global batch than the saved 32,
    # mid-epoch.
    run = succeeded(
        torchrun(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *LONG,
            "--batch-size",
            "24",
            "--checkpoint-dir",
            checkpoints,
            "--save",
            tmp_path / "final.pt",
        )
    )
    aside = checkpoints / "damaged-step-40"
    assert (
        f"checkpoint {checkpoints}/step-40 is damaged ({data_file.name} does not match its "
        f"checksum in checkpoint.json): moved it to {aside}"
    ) in run.output
    assert (aside / data_file.name).read_bytes() == damaged  # set aside as it was, never deleted
    assert f"resumed from {checkpoints}/step-30 (step 30, epoch 2)" in run.output
    # step 30 ended sample 320 of epoch 2; at global batch 48 the steps start at 0, 48, ..., 288
    assert (
        "the global batch changed from 32 to 48: epoch 2 continues at sample 288, not 320, so 32 "
        "samples" in run.output
    )
    assert (
        checkpoints / "step-40" / "checkpoint.json"
    ).exists()  # trained on to step 40 and saved it again
    # every later start says what was set aside, until it is deleted
    again = succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            *LONG,
            "--no-eval",
            "--checkpoint-dir",
            checkpoints,
        )
    )
    assert (
        f"checkpoint {aside} was set aside as damaged ({data_file.name} does not match its "
        "checksum in checkpoint.json): delete it once looked at"
    ) in again.output, again.output
    assert f"resumed from {checkpoints}/step-40 (step 40," in again.output
    assert (
        max_difference(
            load_weights(tmp_path / "final.pt"), load_weights(uninterrupted("ddp") / "final.pt")
        )
        > 0
    )


def test_bad_checkpoints_are_one_line_errors(uninterrupted, mnist_dir, tmp_path):
    intact = copy_checkpoints(uninterrupted("ddp"), tmp_path / "intact")
    broken = copy_checkpoints(uninterrupted("ddp"), tmp_path / "broken")
    (broken / "step-40" / ".metadata").unlink()
    (broken / "step-30" / "checkpoint.json").write_text("{not json")
    # (processes, script, flags, message): started together, they fail while loading; one process
    cases = [
        # where the world size does not matter
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", broken],
            f"no intact checkpoint in {broken}: step-40: .metadata: No such file or directory; "
            "step-30: checkpoint.json "
            "is unreadable: Expecting property name",
        ),
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", intact, "--width", "2"],
            f"checkpoint {intact}/step-40 does not load into this run (Size mismatch between saved "
            "torch.Size([8, 1, 3, "
            "3]) and current: torch.Size([16, 1, 3, 3]) for model.blocks.0.conv1.weight): another "
            "model's? use another "
            "--checkpoint-dir",
        ),
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", intact, "--dataset", "synthetic"],
            "was saved with dataset mnist, this run has dataset synthetic",
        ),
        # --keep-checkpoints 2 deleted step-20 when step-40 was saved: said so, not "damaged"
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", intact, "--resume-from", "step-20"],
            f"--resume-from step-20: no such checkpoint; {intact} holds step-30, step-40: resume "
            "from one of those (step-20 was pruned: --keep-checkpoints 2 keeps the newest 2; "
            "raise it to keep more)",
        ),
        # a step never saved: not "pruned" (test_checkpoint_read_errors_are_not_damage checks)
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", intact, "--resume-from", "step-50"],
            f"--resume-from step-50: no such checkpoint; {intact} holds step-30, step-40: resume "
            "from one of those",
        ),
        # this model's checkpoint, with SGD's state (LONG's): not "another model's"
        (
            1,
            "train_ddp.py",
            ["--checkpoint-dir", intact, "--optimizer", "adamw"],
            f"checkpoint {intact}/step-40 holds this model with --optimizer sgd's state, and this "
            "run has --optimizer adamw: resume with --optimizer sgd, or, to change optimizers, "
            f"start from its weights (python -m plumbing.consolidate {intact}/step-40 weights.pt, "
            "then --init-from weights.pt with another --checkpoint-dir)",
        ),
    ]
    runs = [
        launch(script, processes, *mnist_args(mnist_dir), *LONG, "--batch-size", "16", *flags)
        for processes, script, flags, _ in cases
    ]
    for run, (processes, _, flags, message) in zip(runs, cases):
        assert_one_line_error(run.wait(), str(message))
        assert ("pruned" in run.output) == ("step-20" in flags), run.output
        assert (
            processes > 1 or "Traceback" not in run.output
        )  # (torchrun reports a failed worker with one)
    assert (broken / "step-40").is_dir() and (
        broken / "step-30"
    ).is_dir()  # with none intact, nothing is moved


@pytest.mark.slow  # 24 s on a loaded machine: the README's suite keeps its 8 minutes
def test_checkpoint_read_errors_are_not_damage(uninterrupted, mnist_dir, tmp_path):
    """A file of the newest checkpoint that cannot be read is the environment's, not damage: a real
    EIO (the file a symlink to /proc/self/mem, whose read at offset 0 fails so) exits 75 for
    torchrun to retry; a directory in a file's place (EISDIR; chmod 000 does not stop root) is one
    line, exit 2. Each names the file, and nothing is moved aside or skipped. 2 ranks: the file is
    rank 1's (__1_0.distcp), which rank 1 alone hashes."""
    eio = copy_checkpoints(uninterrupted("ddp"), tmp_path / "eio")
    isdir = copy_checkpoints(uninterrupted("ddp"), tmp_path / "isdir")
    (eio / "step-40" / "__1_0.distcp").unlink()
    (eio / "step-40" / "__1_0.distcp").symlink_to("/proc/self/mem")
    (isdir / "step-40" / "__1_0.distcp").unlink()
    (isdir / "step-40" / "__1_0.distcp").mkdir()
    # a --resume-from path whose checkpoint.json this user may not read (bound by permissions)
    eacces = copy_checkpoints(uninterrupted("ddp"), tmp_path / "eacces")
    (eacces / "step-40" / "checkpoint.json").chmod(0)
    unreadable = bound_by_permissions(
        ["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), *LONG, "--batch-size", "16"]
        + ["--checkpoint-dir", tmp_path / "other", "--resume-from", eacces / "step-40"]
    )
    runs = [
        launch(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *LONG,
            "--batch-size",
            "16",
            "--checkpoint-dir",
            folder,
        )
        for folder in (eio, isdir)
    ]
    read_error = "a read error, not damage; no checkpoint was moved aside or skipped"
    eio_run = runs[0].wait()
    assert eio_run.returncode == 75, eio_run.output
    assert (
        f"error: checkpoint {eio}/step-40: {eio}/step-40/__1_0.distcp cannot be read "
        f"(Input/output error): {read_error}; it may pass on a retry"
    ) in eio_run.output, eio_run.output
    assert_one_line_error(
        runs[1].wait(),
        f"checkpoint {isdir}/step-40: {isdir}/step-40/__1_0.distcp cannot be read (Is a "
        f"directory): {read_error}; fix that, and the same command resumes from it",
    )
    assert_one_line_error(
        unreadable.wait(),
        f"checkpoint {eacces}/step-40: {eacces}/step-40/checkpoint.json cannot be read "
        f"(Permission denied): {read_error}",
    )
    for folder in (eio, isdir, eacces):
        assert sorted(p.name for p in folder.iterdir()) == ["history.json", "step-30", "step-40"]
        assert "resumed from" not in "".join(run.output for run in [*runs, unreadable])
