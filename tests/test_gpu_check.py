"""The GPU check (benchmarks/gpu_check.sh) in its dry run, which needs no GPU: every command it
would run on one exists and parses its flags, so that a change to a script cannot break the check
unseen; and a copy of the project whose script lost a flag the check uses fails it, naming the flag.
"""

import json
import shutil
import sys

import pytest
from conftest import ROOT, Run, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check

from models import data
from plumbing import training

STEPS = ["env", "pytest", "quick", "speed", "gpt", "bf16", "resume"]


def dry_run(root, out):
    env = child_env(PYTHON=sys.executable)  # the check's python: this one, which has torch
    return Run(["bash", root / "benchmarks" / "gpu_check.sh", "--dry-run", out], env=env).wait(120)


def test_the_dry_run_lists_every_step_and_every_command_parses(tmp_path):
    run = dry_run(ROOT, tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    # Every step ran (exit code 0) and recorded its commands; the dry run parsed them all.
    steps = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [(name, code) for name, code, *_ in steps] == [(name, "0") for name in STEPS]
    records = [json.loads((tmp_path / f"{name}.json").read_text()) for name in STEPS]
    commands = [command["argv"] for record in records for command in record["commands"]]
    verified = json.loads((tmp_path / "verify.json").read_text())
    assert verified == {"checked": len(commands), "problems": []} and len(commands) >= 18, verified
    launched = {word for argv in commands for word in argv[:2]}
    assert {
        "run_ddp.sh",
        "run_fsdp.sh",
        "run_pippy.sh",
        "run_tp.sh",
        "train_ddp.py",
        "benchmarks/bare_loop.py",
    } <= launched, launched
    assert all(
        "--device" in argv and argv[argv.index("--device") + 1] == "cuda"
        for argv in commands
        if "--metrics" in argv
    )  # every run on the GPU
    # The table: a row for each step, the transformer rung's (--model gpt-gpu), what needs 2 GPUs.
    table = (tmp_path / "summary.md").read_text()
    assert "A dry run: nothing ran" in table
    assert f"{len(commands)} commands checked, 0 problem" in table
    for title in gpu_check.TITLES.values():
        assert f"| {title} |" in table, title
    assert (
        "no GPT at nanoGPT's size" not in table
        and "`python3 train_ddp.py --model gpt-gpu " in table
    )
    # The transformer rung's command parses to nanoGPT's size and recipe, shortened, and its plan
    # starts (a warmup of at most half the run).
    (gpt,) = [argv for argv in commands if argv[1:4] == ["train_ddp.py", "--model", "gpt-gpu"]]
    args = training.parser("", data.add_arguments).parse_args(gpt[2:])
    recipe = (args.batch_size, args.lr, args.weight_decay, args.max_grad_norm, args.epochs)
    assert recipe == (64, 1e-3, 0.1, 1.0, 100) and args.precision == "bf16", vars(args)
    assert args.max_steps == gpu_check.GPT_STEPS == 1000, vars(args)
    assert training.peak_and_warmup(args, args.batch_size, args.max_steps) == (1e-3, 100)
    assert f"shortened to {gpu_check.GPT_STEPS:,} of its 5,000 steps" in table
    assert table.count("| not run: needs 2+ GPUs |") >= 5
    assert "| failed |" not in table and "timed out" not in table, table
    assert f"dry run: {len(commands)} commands checked, 0 problem(s)" in run.output


# two more dry runs: the one above keeps a script's change from breaking the check unnoticed
@pytest.mark.slow
def test_a_copy_whose_scripts_changed_fails_the_dry_run_or_runs_less(tmp_path):
    # A copy of the project with two changes. The negative control: its shared parser renamed
    # --no-eval, a flag the speed step passes to train_ddp.py. And models/data.py without --model,
    # as before the transformer rung (issue 43): the check must then say the rung is absent.
    copy = tmp_path / "copy"
    for folder in ("plumbing", "models", "benchmarks"):  # what the check reads, not the data
        shutil.copytree(
            ROOT / folder,
            copy / folder,
            ignore=shutil.ignore_patterns("mnist", "results", "__pycache__"),
        )
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*.sh"), ROOT / "tests" / "test_gpu.py"]:
        (copy / path.relative_to(ROOT)).parent.mkdir(exist_ok=True)
        shutil.copy2(path, copy / path.relative_to(ROOT))
    edit(copy / "plumbing" / "training.py", 'add("--no-eval"', 'add("--skip-eval"')
    edit(copy / "models" / "data.py", 'choices=("cnn", *GPT_CONTEXT)', 'choices=("cnn",)')
    run = dry_run(copy, tmp_path / "out")
    assert run.returncode == 1, run.output[-3000:]
    assert "train_ddp.py has no flag --no-eval" in run.output, run.output[-3000:]
    problems = json.loads((tmp_path / "out" / "verify.json").read_text())["problems"]
    assert problems and all("has no flag --no-eval" in p for p in problems), problems
    table = (tmp_path / "out" / "summary.md").read_text()
    assert f"{len(problems)} problem(s)" in table
    assert "| not run: no GPT at nanoGPT's size in this commit (issue 43) |" in table


def edit(path, old, new):
    assert path.read_text().count(old) == 1, old
    path.write_text(path.read_text().replace(old, new))


def test_the_dry_runs_stand_in_metrics_have_the_real_ones_shape(reference_metrics, tmp_path):
    """The dry run feeds the steps' code stand-in --metrics files: only keys the scripts write."""
    path = tmp_path / "m.json"
    gpu_check.pretend(["python3", "train_ddp.py", "--max-steps", "100", "--metrics", str(path)])
    stand_in = json.loads(path.read_text())
    assert set(stand_in) <= set(reference_metrics), set(stand_in) - set(reference_metrics)
    assert set(stand_in["ranks"][0]) <= set(reference_metrics["ranks"][0])
    assert all(len(point) == 3 for point in reference_metrics["loss_curve"])  # step, loss, seconds
    assert gpu_check.steady_state(stand_in)[1] > 0
