"""--model gpt, launched for real on the bundled Tiny Shakespeare: it learns under DDP, and DDP,
FSDP, the pipeline (with replicas too) and TP (tp_plan(), with FSDP over dp too) follow one
process's fp64 steps on it (the loss over every token's target, integer inputs through the
batches, the stages and the gathers)."""

import math
import re

import pytest
import torch
from conftest import (
    CONTROL_FLOOR,
    ROOT,
    TOLERANCE,
    load_weights,
    python,
    relative_difference,
    succeeded,
    torchrun,
)

from models import GPT

# fp64, >= 10 optimizer steps of 2 micro-steps, clipped (the norm over every rank's gradients);
# no evaluation: the validation split costs tens of seconds a run here (training.evaluate over
# tokens is tests/test_gpt.py's).
EQUIVALENT = ["--model", "gpt", "--precision", "fp64", "--optimizer", "sgd", "--lr", "0.3"]
EQUIVALENT += ["--warmup-steps", "2", "--max-steps", "10", "--grad-accum", "2", "--log-every", "5"]
EQUIVALENT += ["--max-grad-norm", "0.5", "--no-eval"]
GLOBAL_BATCH = 16  # windows of 64 characters a micro-step, all ranks together


def initial_weights():
    torch.manual_seed(0)  # --seed 0's GPT, before any step
    return GPT(65, 64).state_dict()


# Slow: the README's command took 8 min 4 s in a clean-clone CI run with it, over its 8 minutes.
@pytest.mark.slow
def test_two_ddp_ranks_teach_the_gpt_the_text_in_twenty_steps(tmp_path):
    # The negative control, measured here: the untrained GPT's loss on the first windows is about
    # ln(65) = 4.17 (every character equally likely); 20 steps of batch 32 bring the last 10 steps'
    # mean below 3.3, which takes learning at least the characters' frequencies (about 3.3).
    from models import data, shakespeare

    found = data.find(None, None, model="gpt")
    train_set, _ = shakespeare.datasets(found["splits"], torch.device("cpu"))
    inputs, targets = train_set[torch.arange(32)]
    with torch.no_grad():
        torch.manual_seed(0)  # --seed 0's GPT
        logits = GPT(65, 64)(inputs)
    untrained = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(untrained - math.log(65)) < 0.1, untrained
    run = succeeded(
        torchrun(
            "train_ddp.py",
            2,
            "--model",
            "gpt",
            "--batch-size",
            "16",
            "--max-steps",
            "20",
            "--log-every",
            "10",
            "--no-eval",
        )
    )
    assert "shakespeare; 20 steps" in run.output  # --dataset's default with --model gpt
    losses = [float(x) for x in re.findall(r"step \d+/20: loss \(all ranks\) ([\d.]+)", run.output)]
    assert len(losses) == 2 and losses[1] < 3.3 < untrained - 0.8, losses
    text = run.output.split("the trained GPT writes 240 characters:\n", 1)[1]
    assert len(text) >= 240 and set(text[:240]) <= set(train_set.vocabulary), text


PIPELINE = ["--schedule", "1f1b", "--microbatches", "2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process's weights at the global batch, the reference of every layout below, and the
    negative control: one process at a rank's share of the batch, as a rank whose gradients
    nothing averaged. Launched once for the module (each layout's test launched both)."""
    directory = tmp_path_factory.mktemp("one_process")
    runs = [
        python("train_ddp.py", *EQUIVALENT, "--batch-size", batch, "--save", directory / name)
        for name, batch in (("one.pt", GLOBAL_BATCH), ("control.pt", GLOBAL_BATCH // 2))
    ]
    for run in runs:
        succeeded(run)
    return load_weights(directory / "one.pt"), load_weights(directory / "control.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, ranks, batch, flags",
    [
        # --deterministic changes no math: on a CPU the kernels are deterministic already.
        ("train_ddp.py", 2, GLOBAL_BATCH // 2, ["--deterministic"]),
        ("train_fsdp.py", 2, GLOBAL_BATCH // 2, []),
        # The pipeline keeps a replica's batch on each of its ranks; DDP and FSDP split it.
        ("train_pippy.py", 2, GLOBAL_BATCH, PIPELINE),
        ("train_pippy.py", 4, GLOBAL_BATCH // 2, [*PIPELINE, "--data-parallel", "2"]),
        # TP's ranks share a batch: tp_plan(), sequence parallelism and loss_parallel().
        ("train_tp.py", 2, GLOBAL_BATCH, ["--tp", "2"]),
        ("train_tp.py", 4, GLOBAL_BATCH // 2, ["--tp", "2"]),
    ],
    ids=[
        "ddp-2",
        "fsdp-2",
        "pipeline-2-stages",
        "pipeline-2-stages-x-2-replicas",
        "tp-2",
        "tp-2-x-dp-2",
    ],
)
def test_the_gpt_trains_as_one_process_does_in_fp64(
    script, ranks, batch, flags, one_process, tmp_path
):
    path = tmp_path / "run.pt"
    run = torchrun(script, ranks, *EQUIVALENT, "--batch-size", batch, *flags, "--save", path)
    succeeded(run)
    initial = initial_weights()
    reference, control = one_process
    assert relative_difference(control, reference, initial) > CONTROL_FLOOR
    assert relative_difference(load_weights(path), reference, initial) < TOLERANCE
    assert "the trained GPT writes 240 characters:" in run.output  # from the gathered weights
    # The transformer page quotes FSDP's units and the pipeline's stages from these start lines.
    page = " ".join((ROOT / "docs" / "transformer.md").read_text().split())
    if script == "train_fsdp.py":
        units, share = re.search(r"(\d+) units, the largest (\d+)% of", run.output).groups()
        assert f"{units} units in all. The largest, a transformer block, holds {share} %" in page
    if script == "train_pippy.py" and ranks == 2:
        stages = re.search(r"2 stages: blocks \[\[[^;]*?\]\]", run.output).group()
        assert f"it prints `{stages}`" in page, stages
    if "--deterministic" in flags:  # said on the start line; no op lacks a deterministic kernel
        assert "fp64, deterministic; shakespeare" in run.output, run.output
        assert "does not have a deterministic implementation" not in run.output, run.output
