"""Bad input, every case in one table: one `error:` line from rank 0, exit code 2, nothing written,
launched as a user launches it (`bash run_ddp.sh`, torchrun and all: no traceback of its own may
follow the line), with MAX_RESTARTS=2: torchrun does not try a bad input again, so the line is said
once.

A case is one line: (script, processes, flags, the error line it must give). One process where the
world size does not matter. All cases start at once and fail within seconds, before any training
(except the diverging one, which stops at its first logging window). 8 of them get past the flags
and meet in their own rendezvous (RENDEZVOUS): 8 launches started together, none of which may take
another's port (a traceback from init_process_group, not one line, when one did). Each kind of
refusal is launched once; other inputs refused the same way are checked where they are refused (the
shared parser, data.find): a launch costs seconds of imports, and those cases differ only in the
message.

Two tables of the same kind live beside what they need: bad launcher variables (an environment, not
flags) in test_launch.py, and bad checkpoints (made from its uninterrupted runs) in
test_checkpoint.py.
"""

import importlib
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    ROOT,
    Run,
    _write_idx,
    assert_one_line_error,
    child_env,
    launcher_env,
    mnist_args,
    python,
    run_sh,
)

from models import data
from models.data import synthetic_digits
from plumbing import failures, training

CASES = {
    # flags: the parser of each script
    "zero-batch": (
        "train_ddp.py",
        1,
        ["--batch-size", "0"],
        "argument --batch-size: must be at least 1, got 0",
    ),
    # layouts and devices
    "batch-over-shard": (
        "train_ddp.py",
        2,
        [*mnist_args("{mnist}"), "--batch-size", "321"],
        "is more than the 320 samples each of the 2 ranks gets",
    ),
    # The suite hides the GPUs (conftest.child_env), so every rank finds none; on a GPU node the
    # same check stops, in one line per node, more processes than GPUs.
    "cuda-without-gpus": (
        "train_ddp.py",
        2,
        ["--device", "cuda"],
        "2 processes on this node need 2 GPUs, but torch sees 0",
    ),
    # output paths, checked at start-up
    "unwritable-save": (
        "train_ddp.py",
        1,
        [*mnist_args("{mnist}"), "--save", "{tmp}"],
        "--save {tmp}: cannot write there",
    ),
    "save-is-metrics": (
        "train_ddp.py",
        1,
        [*mnist_args("{mnist}"), "--save", "{tmp}/run", "--metrics", "{tmp}/run"],
        "--save and --metrics are both {tmp}/run: the metrics would replace the weights",
    ),
    "save-names-a-directory": (
        "train_ddp.py",
        1,
        [*mnist_args("{mnist}"), "--save", "{tmp}/new/"],
        "--save {tmp}/new/: cannot write there (it names a directory, not a file)",
    ),
    "checkpoint-dir-is-a-file": (
        "train_ddp.py",
        1,
        [*mnist_args("{mnist}"), "--checkpoint-dir", "{tmp}/file"],
        "--checkpoint-dir {tmp}/file: cannot write there (it is a file, not a directory)",
    ),
    # data: missing, and damaged (the other damages: DAMAGED below)
    "missing-mnist": (
        "train_ddp.py",
        1,
        [*mnist_args("{tmp}/missing")],
        "put the files in {tmp}/missing/MNIST/raw/",
    ),
    "label-255": (
        "train_ddp.py",
        1,
        [*mnist_args("{bad}/label-255")],
        "train-labels-idx1-ubyte has label 255 at index 0; mnist labels are 0 to 9",
    ),
    # training
    "diverged": (
        "train_ddp.py",
        1,
        [
            *mnist_args("{mnist}"),
            "--lr",
            "1e30",
            "--max-steps",
            "5",
            "--log-every",
            "1",
            "--no-eval",
            "--save",
            "{tmp}/diverged.pt",
        ],
        "training diverged; lower --lr",
    ),
}
RENDEZVOUS = [
    "batch-over-shard",
    "unwritable-save",
    "save-is-metrics",
    "save-names-a-directory",
    "checkpoint-dir-is-a-file",
    "missing-mnist",
    "label-255",
    "diverged",
]  # found after init_process_group
# Refused by the parser the three scripts share, as zero-batch is: (flags, the error).
FLAGS = {
    "unknown-dataset": (
        ["--dataset", "imagenet"],
        "argument --dataset: invalid choice: 'imagenet'",
    ),
    "weight-decay-nan": (
        ["--weight-decay", "nan"],
        "argument --weight-decay: must be at least 0, got nan",
    ),
    "weight-decay-negative": (
        ["--weight-decay", "-1"],
        "argument --weight-decay: must be at least 0, got -1",
    ),
    "momentum-negative": (
        ["--momentum", "-1"],
        "argument --momentum: must be at least 0 and below 1, got -1",
    ),
}
# Refused by the flags a script adds to the shared parser, before anything else its main() does, as
# zero-batch is by train_ddp.py's: (module, flags, the error).
SCRIPT_FLAGS = {
    "replicate-degree-0": (
        "train_fsdp",
        ["--replicate-degree", "0"],
        "argument --replicate-degree: must be at least 1, got 0",
    ),
    "stages-per-rank-0": (
        "train_pippy",
        ["--stages-per-rank", "0"],
        "argument --stages-per-rank: must be at least 1, got 0",
    ),
}
# Damaged files found by data.find, as label-255 is: the error.
DAMAGED = {
    "fewer-labels": "train-labels-idx1-ubyte holds 639 labels for the 640 images",
    "no-labels": "train-labels-idx1-ubyte holds 0 labels for the 640 images",
    "random-bytes": "train-images-idx3-ubyte is not an IDX file of 3-D uint8 data",
    "truncated-images": "train-images-idx3-ubyte is truncated",
}


def bad_mnist(root):
    """One MNIST directory per kind of damage, each otherwise valid (640 training, 300 test
    images)."""
    (train_x, train_y), (test_x, test_y) = (
        synthetic_digits(640, seed=10),
        synthetic_digits(300, seed=11),
    )
    damage = {
        "label-255": lambda files: files["train-labels-idx1-ubyte"].__setitem__(0, 255),
        "fewer-labels": lambda files: files.__setitem__("train-labels-idx1-ubyte", train_y[:-1]),
        "no-labels": lambda files: files.__setitem__("train-labels-idx1-ubyte", train_y[:0]),
        "random-bytes": None,
        "truncated-images": None,
    }
    for name, change in damage.items():
        raw = root / name / "MNIST" / "raw"
        raw.mkdir(parents=True)
        files = {
            "train-images-idx3-ubyte": train_x[:, 0],
            "train-labels-idx1-ubyte": train_y.clone(),
            "t10k-images-idx3-ubyte": test_x[:, 0],
            "t10k-labels-idx1-ubyte": test_y,
        }
        if change:
            change(files)
        for file, tensor in files.items():
            _write_idx(raw / file, tensor)
    images = root / "random-bytes" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    noise = torch.randint(
        0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    images.write_bytes(noise.numpy().tobytes())
    images = root / "truncated-images" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1000])


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    bad = tmp_path_factory.mktemp("bad-mnist")
    bad_mnist(bad)
    return bad


@pytest.fixture(scope="module")
def runs(mnist_dir, bad_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "file").write_text("not a directory")
    fill = {"tmp": str(tmp), "mnist": str(mnist_dir), "bad": str(bad_data)}
    started = {
        case: run_sh(
            script,
            processes,
            *[str(a).format(**fill) for a in flags],
            env=child_env(MAX_RESTARTS=2),
        )
        for case, (script, processes, flags, _) in CASES.items()
    }
    return started, fill


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_from_rank_zero_and_not_retried(case, runs):
    started, fill = runs
    run = started[case].wait()
    assert_one_line_error(run, CASES[case][3].format(**fill))  # one line: said once, by one attempt
    assert (
        "Address already in use" not in run.output
    )  # RENDEZVOUS: the line came after the process group
    assert not os.path.exists(
        os.path.join(fill["tmp"], "diverged.pt")
    )  # a diverged run saves nothing
    assert not os.path.exists(os.path.join(fill["tmp"], "run"))


@pytest.mark.parametrize("case", FLAGS)
def test_a_bad_flag_is_refused_by_the_parser_the_scripts_share(case):
    flags, message = FLAGS[case]
    with pytest.raises(failures.UsageError) as refused:
        training.parser("", data.add_arguments).parse_args(flags)
    assert str(refused.value).startswith(message) and str(refused.value).endswith(
        " (see --help)"
    ), refused.value


@pytest.mark.parametrize("case", SCRIPT_FLAGS)
def test_a_bad_flag_of_one_script_is_refused_by_its_parser(case, monkeypatch):
    module, flags, message = SCRIPT_FLAGS[case]
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *flags])
    with pytest.raises(failures.UsageError) as refused:
        importlib.import_module(module).main()
    assert str(refused.value).startswith(message) and str(refused.value).endswith(
        " (see --help)"
    ), refused.value


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_data_is_found_before_the_process_group(case, bad_data):
    found = data.find("mnist", bad_data / case, download=False)
    assert DAMAGED[case] in found["broken"], found["broken"]


def test_a_bad_input_without_torchrun_is_one_line(mnist_dir):
    run = python("train_ddp.py", *mnist_args(mnist_dir), "--batch-size", "641", fork=False).wait()
    assert_one_line_error(
        run,
        "--batch-size 641 x --grad-accum 1 is more than the 640 samples each of the 1 ranks "
        "gets from mnist; make it smaller",
    )


def test_help_prints_once_and_a_missing_script_is_one_line():
    run = Run(["bash", ROOT / "run_fsdp.sh", "--help"], env=launcher_env()).wait()
    assert run.returncode == 0 and run.output.count("usage: train_fsdp.py") == 1, run.output
    run = Run(["bash", ROOT / "launch.sh", "train_nope.py"], env=launcher_env()).wait()
    assert run.returncode == 2 and run.output.splitlines() == [
        f"error: no training script {ROOT}/train_nope.py: use run_ddp.sh, run_fsdp.sh, "
        "run_pippy.sh or run_tp.sh "
        "(or bash launch.sh train_ddp.py|train_fsdp.py|train_pippy.py|train_tp.py)"
    ], run.output


def with_full_disk(directory, command, before=":"):
    """Run ``command`` with a 300 kB file system of its own at ``directory`` (a user and mount
    namespace: no root needed), ``before`` run there first; what the directory holds at the end is
    listed in ``directory``.left."""
    script = (
        f'mount -t tmpfs -o size=300k tmpfs "{directory}" && cd "{directory}" && {before} && "$@"; '
        "code=$?; "
        f'find . -mindepth 1 | sort > "{directory}.left"; exit $code'
    )
    return Run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "bash",
            "-c",
            script,
            "--",
            *map(str, command),
        ],
        env=launcher_env(NPROC_PER_NODE=2),
    )


def bound_by_permissions(command, cwd=None, **env):
    """Start ``command`` (2 processes) so that file permissions bind it: under root, in a user
    namespace of its own, where the real root's files are not its own and root's right to ignore
    permissions does not reach them."""
    command = [str(part) for part in command]
    return Run(
        command if os.geteuid() else ["unshare", "--user", *command],
        cwd=cwd,
        env=launcher_env(NPROC_PER_NODE=2, **env),
    )


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_full_disk_is_one_line_that_names_the_path_and_the_space(mnist_dir, tmp_path):
    flags = [
        *mnist_args(mnist_dir),
        "--epochs",
        "4",
        "--max-steps",
        "20",
        "--no-eval",
        "--log-every",
        "10",
    ]
    for name in ("save", "checkpoint"):
        (tmp_path / name).mkdir()
    runs = {  # --save over an older file of that name, at the end; a checkpoint, at step 10
        "save": with_full_disk(
            tmp_path / "save",
            ["bash", ROOT / "run_ddp.sh", *flags, "--save", "old.pt"],
            before="head -c 250000 /dev/zero > old.pt",
        ),
        "checkpoint": with_full_disk(
            tmp_path / "checkpoint",
            [
                "bash",
                ROOT / "run_ddp.sh",
                *flags,
                "--checkpoint-dir",
                "ck",
                "--checkpoint-every",
                "10",
            ],
        ),
    }
    for name, run in runs.items():
        assert_one_line_error(run.wait(), "(the disk is full: ")
        output, left = run.output, (tmp_path / f"{name}.left").read_text()
        line = output.splitlines()[-1]
        free, needed = map(
            float,
            re.search(
                r"([\d.]+) MB are free there, this needs at least ([\d.]+) MB", line
            ).groups(),
        )
        assert free < needed < 1, (
            line
        )  # BabyCNN's 43k parameters: 0.17 MB, with AdamW's state 0.5 MB
        if name == "save":
            assert line.startswith(
                "error: old.pt was not written (the disk is full: "
            ) and left.split() == ["./old.pt"]
            assert "step 20/20" in output  # found at the end: training ran
        else:
            assert line.startswith(
                "error: checkpoint step-10 was not written to ck (the disk is full: "
            )
            assert line.endswith(
                "the ones saved before it are intact; fix that, and the same command resumes from "
                "them"
            )
            assert left.split() == ["./ck"], left  # no .tmp-step-10 left behind


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_data_directory_this_user_cannot_read_is_named_as_such(mnist_dir, tmp_path):
    shutil.copytree(mnist_dir, tmp_path / "data")
    (tmp_path / "data" / "MNIST" / "raw").chmod(0)
    run = bound_by_permissions(["bash", ROOT / "run_ddp.sh", *mnist_args(tmp_path / "data")])
    try:
        assert_one_line_error(
            run.wait(),
            f"error: {tmp_path}/data/MNIST/raw cannot be read by this user (permission "
            "denied): let it read it",
        )
    finally:
        (tmp_path / "data" / "MNIST" / "raw").chmod(0o755)


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_checkpoint_directory_made_read_only_mid_run_is_one_line(mnist_dir, tmp_path):
    command = [
        "bash",
        ROOT / "run_ddp.sh",
        *mnist_args(mnist_dir),
        "--epochs",
        "50",
        "--log-every",
        "1",
        "--no-eval",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "10",
    ]
    run = bound_by_permissions(command, cwd=tmp_path)
    run.wait_for_text(
        "step 3/"
    )  # checked writable at the start; read-only before the first checkpoint, at step 10
    (tmp_path / "ck").chmod(0o555)
    try:
        assert_one_line_error(
            run.wait(),
            "error: checkpoint step-10 was not written to ck (Permission denied): the ones "
            "saved before it are intact; fix that, and the same command resumes from them",
        )
        assert list((tmp_path / "ck").iterdir()) == []
    finally:
        (tmp_path / "ck").chmod(0o755)


def test_a_warmup_longer_than_half_the_run_is_refused_and_the_default_one_is_shortened():
    # Refused where the run's length is known (training.Plan, after the data): one line on rank
    # 0, as any UsageError found after init_process_group (batch-over-shard above).
    args = training.parser("test").parse_args(["--warmup-steps", "17"])
    with pytest.raises(failures.UsageError) as refused:
        training.peak_and_warmup(args, 64, total_steps=32)
    assert str(refused.value) == (
        "--warmup-steps 17 is more than half of this run's 32 steps: the lr would stay below "
        "its peak 0.003 for most of the run; give at most 16"
    )
    args = training.parser("test").parse_args(
        ["--warmup-steps", "1"]
    )  # a one-step run: 0 is the only warmup it takes
    with pytest.raises(failures.UsageError, match=r"1 steps: .*; give at most 0$"):
        training.peak_and_warmup(args, 64, total_steps=1)
    # The default: 100 steps, or a fifth of a shorter run; the lr reaches the peak when the warmup
    # ends.
    default = training.parser("test").parse_args(["--lr-schedule", "constant", "--epochs", "1"])
    for total_steps, warmup in ((32, 6), (499, 99), (5000, 100)):
        plan = training.Plan(default, 64 * total_steps, 1, "test")  # one rank, batch 64
        peak, warmup_steps, lr_at = plan.peak_lr, plan.warmup_steps, plan.lr
        assert warmup_steps == warmup and lr_at(warmup - 1) < peak == lr_at(warmup), (
            total_steps,
            warmup_steps,
        )


# Data that does not fit the model, as in a copy of a script with a model of its own: found before
# the first step (token ids where the model first runs, in training.check_data_fits; labels and
# targets in the data held on the device, all of it), one line, exit code 2. Unfound, a GPU meets
# them as a device-side assert, which used to be retried as "a collective failed", and a CPU as
# an IndexError's traceback. A case: (the line that replaces models.build's in a copy of
# train_ddp.py, its flags, the error).
BUILD = "    model = models.build(args, train_set, device, dtype)  # --model, for the data\n"
LOAD = (
    "    dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)\n"
)
# rank 0's 101st sample of epoch 1 (DistributedSampler's order over the 640 of mnist_dir, 2 ranks):
# in its second batch of 64
DEEP = torch.randperm(640, generator=torch.Generator().manual_seed(0))[2 * 100].item()
MISFITS = {
    "token-id-beyond-the-vocabulary": (
        "    size = {**models.SIZES[args.model], 'block_size': train_set.block_size}\n"
        "    model = models.GPT(train_set.vocab_size - 5, **size, device=device, dtype=dtype)\n",
        ["--model", "gpt"],
        # found in the first test sample, whose largest id is 'y' or 'z', of 65
        ", outside the model's vocabulary of 60 (the rows of blocks.0.tokens): fix the data, or "
        "give the model a vocabulary of at least 6",
    ),
    "label-outside-the-classes": (
        "    model = models.BabyCNN(1, 5, 28, 1, device=device, dtype=dtype)\n",
        mnist_args("{mnist}"),
        "of the training set has label 9, outside the model's 5 classes (its logits' last "
        "dimension): "
        "fix the data, or give the model at least 10 outputs",
    ),
    # read through a DataLoader (a TensorDataset on the CPU, for workers): checked whole, first
    "label-outside-the-classes-read-by-workers": (
        "    model = models.BabyCNN(1, 5, 28, 1, device=device, dtype=dtype)\n",
        [*mnist_args("{mnist}"), "--workers", "1"],
        "outside the model's 5 classes (its logits' last dimension): fix the data, or give the "
        "model at least ",
    ),
    # a test set held in memory (a TensorDataset on the CPU, for --workers): checked whole,
    # before step 1, not as its first batch is drawn after the first epoch
    "a-label-in-a-test-set-held-in-memory": (
        (LOAD, LOAD + "    test_set.tensors[1][250] = 12\n"),
        [*mnist_args("{mnist}"), "--workers", "1"],
        "error: sample 250 of the test set has label 12, outside the model's 10 classes",
    ),
    # a Dataset of the user's (not a TensorDataset), read by a worker: every batch is checked as it
    # is drawn, on the host; this sample is in rank 0's second batch (DEEP)
    "a-label-deep-in-a-dataloaders-training-set": (
        (
            LOAD,
            LOAD
            + f"    train_set.tensors[1][{DEEP}] = 12\n"
            + "    train_set = torch.utils.data.Subset(train_set, range(len(train_set)))\n",
        ),
        [*mnist_args("{mnist}"), "--workers", "1"],
        f"error: sample {DEEP} of the training set has label 12, outside the model's 10 classes",
    ),
    "targets-of-another-shape": (
        "    model = models.BabyCNN(1, 10, 28, 1, device=device, dtype=dtype)\n"
        "    model = torch.nn.Sequential(model, torch.nn.Unflatten(1, (2, 5)))\n",
        mnist_args("{mnist}"),
        "error: the data's targets are [] a sample, and the model's logits [2, 5]: cross_entropy "
        "takes a class index per row of logits, [2] a sample; make the model's output or the "
        "labels fit",
    ),
}


@pytest.fixture(scope="module")
def misfits(mnist_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misfits")
    script = (ROOT / "train_ddp.py").read_text()
    assert script.count(BUILD) == 1  # the line a copy replaces (README: Copy a script)
    started = {}
    assert script.count(LOAD) == 1
    for case, (build, flags, _) in MISFITS.items():
        old, new = (BUILD, build) if isinstance(build, str) else build
        (tmp / f"{case}.py").write_text(script.replace(old, new))
        flags = [str(flag).format(mnist=mnist_dir) for flag in flags]
        started[case] = Run(
            ["bash", ROOT / "launch.sh", tmp / f"{case}.py", *flags, "--log-every", "1"],
            env=launcher_env(NPROC_PER_NODE=2, MAX_RESTARTS=2),
        )
    return started


@pytest.mark.parametrize("case", MISFITS)
def test_data_that_does_not_fit_the_model_is_one_line_before_the_first_step(case, misfits):
    run = misfits[case].wait()
    assert_one_line_error(run, MISFITS[case][2])
    assert "attempt" not in run.output, run.output
    if "deep" in case:  # found as its batch was drawn: after step 1, before step 2
        assert "step 1/" in run.output and "step 2/" not in run.output, run.output
    else:
        assert "step 1/" not in run.output, run.output


FILE_CLUSTERS = """
import os

_Points = Clusters


class Clusters(torch.utils.data.Dataset):  # the same points, read from a file a sample
    def __init__(self, count, seed):
        self.folder, self.count = os.path.join(os.environ["CLUSTERS"], str(seed)), count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        with open(os.path.join(self.folder, f"{index}.txt")) as file:
            x, y, label = file.read().split()
        return torch.tensor([float(x), float(y)]), int(label)
"""


@pytest.mark.slow  # 4 launches of 2 ranks, each training to the file: 50 s on 2 cores
def test_the_users_own_data_file_missing_or_unreadable_is_one_line_also_from_a_worker(tmp_path):
    """The README's copy with a Dataset that reads a file a sample: a training file missing (with
    and without DataLoader workers), unreadable (chmod 000, bound by permissions) or failing with a
    real EIO (a symlink to /proc/self/mem). Each is one line naming the file and the OS error: the
    first two exit 2, never retried; the EIO is the storage's, exit 75. A worker re-raises its
    error without the errno and with its whole traceback: the line must come through it whole."""
    from test_template import copy_command, make_copy

    project, user_file = make_copy(tmp_path, ["train_ddp.py"])
    (project / "mymodel.py").write_text(user_file + FILE_CLUSTERS)
    points = {}
    exec(user_file, points)
    for seed, count in ((0, 4096), (1, 1024)):
        folder = tmp_path / "clusters" / str(seed)
        folder.mkdir(parents=True)
        data = points["Clusters"](count, seed)
        for index in range(count):
            x, y = data.points[index].tolist()
            (folder / f"{index}.txt").write_text(f"{x} {y} {data.labels[index].item()}")
    cases = {  # name: (the training file's fate, --workers)
        "missing": ("unlink", "0"),
        "missing-in-a-worker": ("unlink", "1"),
        "unreadable-in-a-worker": ("chmod", "1"),
        "eio-in-a-worker": ("eio", "1"),
    }
    runs = {}
    for name, (fate, workers) in cases.items():
        folder = tmp_path / name
        shutil.copytree(tmp_path / "clusters", folder)
        bad = folder / "0" / "100.txt"
        bad.unlink()
        if fate == "chmod":
            bad.write_text("1 1 0")
            bad.chmod(0)
        elif fate == "eio":
            bad.symlink_to("/proc/self/mem")
        command = [*copy_command(), "--epochs", "1", "--no-eval", "--workers", workers]
        env = {"CLUSTERS": folder, "PYTHONPATH": project}
        if fate == "chmod":
            runs[name] = bound_by_permissions(command, cwd=project, **env)
        else:
            runs[name] = Run(command, env=launcher_env(NPROC_PER_NODE=2, **env), cwd=project)
    for name, run in runs.items():
        bad = tmp_path / name / "0" / "100.txt"
        if name.startswith("eio"):
            run.wait()
            assert run.returncode == 75, run.output
            line = "error: the data (sample 100): reading a file failed (Input/output error); it "
            line += "may pass on a retry"  # (a read's OSError names no file)
            assert line in run.output, run.output
            continue
        why = "Permission denied" if name.startswith("unreadable") else "No such file or directory"
        line = f"the data (sample 100): {bad} cannot be read ({why}): fix it, or the path to it"
        assert_one_line_error(run.wait(), line)
