"""--compile on the CPU: what could make a compiled step slower than eager, unseen. A graph break
splits the model into pieces run by Python in between; a recompilation compiles again in the middle
of training. Under DDP and FSDP, for BabyCNN and the GPT, no graph break happens, and no
recompilation after the first step: the runs log each one (TORCH_LOGS); the evaluation, eager, adds
none. BabyCNN's DDP run, on two ranks in float64, also does the same math as the eager reference.
And the GPT compiled as train_ddp.py compiles it trains, evaluates and trains on under torch's
fail_on_recompile stance; its control: a no_grad forward outside the evaluation's eager stance
fails on recompiling."""

import argparse
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    EQUIVALENCE,
    assert_same_math,
    child_env,
    load_weights,
    mnist_args,
    python,
    succeeded,
    torchrun,
)
from torch.utils.data import TensorDataset

RECOMPILES = re.compile(r"\[__recompiles\] Recompiling function")
BREAKS = re.compile(r"\[__graph_breaks\] Graph break")


@pytest.mark.slow  # four compiles, half a minute each
def test_no_graph_break_and_no_recompilation_in_a_compiled_training_step(
    reference, control, mnist_dir, tmp_path
):
    """BabyCNN under DDP is the whole model compiled, then wrapped in DDP (whose graph dynamo would
    split at the gradient buckets; this model fills one), on two ranks in float64: the same
    weights as the eager reference (on a CPU there are no CUDA graphs; the math is what is
    checked), and evaluated at the end: the control that the eager evaluation compiles nothing."""
    layouts = {
        ("train_ddp.py", "cnn"): [*mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16"],
        ("train_ddp.py", "gpt"): ["--no-eval", "--max-steps", "20"],
        ("train_fsdp.py", "cnn"): ["--no-eval", "--max-steps", "20"],
        ("train_fsdp.py", "gpt"): ["--no-eval", "--max-steps", "20"],
    }
    runs, steps = {}, {}
    for (script, model), flags in layouts.items():
        # A cache of its own: torch 2.14's inductor cache, filled under one ATEN_CPU_CAPABILITY,
        # segfaults when read under another (seen with avx2 after AVX-512 runs on one machine).
        cache = tmp_path / f"{script}-{model}"
        env = child_env(TORCH_LOGS="recompiles,graph_breaks", TORCHINDUCTOR_CACHE_DIR=cache)
        flags = [*flags, "--model", model, "--compile", "--log-every", "1"]
        steps[script, model] = int(flags[flags.index("--max-steps") + 1])
        if model == "cnn" and script == "train_ddp.py":  # workers: new processes, as a user's
            runs[script, model] = torchrun(
                script, 2, *flags, "--save", tmp_path / "ddp.pt", env=env
            )
        else:  # a new process: torch reads TORCH_LOGS on import
            runs[script, model] = python(script, *flags, env=env, fork=False)
    for (script, model), run in runs.items():
        output = succeeded(run.wait(480)).output  # four compiles at once: minutes on a busy CPU
        # Step 1 compiles each block's kind of input once (FSDP: the first block's input needs
        # no gradient, the others' do); the later steps must run what it compiled.
        last = steps[script, model]
        later = output.partition(f"step 1/{last}")[2].partition(f"step {last}/{last}")[0]
        assert f"step {last - 1}/{last}" in later, output
        assert not RECOMPILES.search(later) and not BREAKS.search(output), (script, model, output)
    ddp = runs["train_ddp.py", "cnn"].output
    assert "DDP on 2 rank(s)" in ddp, ddp
    evaluation = ddp.partition(f"step {steps['train_ddp.py', 'cnn']}/")[2]
    assert "test accuracy" in evaluation and not RECOMPILES.search(evaluation), evaluation
    assert_same_math(load_weights(tmp_path / "ddp.pt"), reference, control)


@pytest.mark.slow  # one inductor compile: about 35 s of CPU
def test_the_compiled_gpt_trains_evaluates_and_trains_on_without_recompiling(monkeypatch, tmp_path):
    """train_ddp.py's compile_model (dynamic=False) on a small GPT: one step compiles; then, under
    fail_on_recompile, two more steps, training.evaluate (eval mode, no_grad, batches of 4 and a
    last one of 3) and three more steps. The control: the evaluation's forward outside its eager
    stance is a recompilation, which the stance refuses."""
    from models import GPT
    from plumbing import training
    from train_ddp import compile_model

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # see the test above
    torch.manual_seed(0)
    model = GPT(65, 16, n_layer=1, n_head=2, n_embd=32)
    flags = argparse.Namespace(compile=True, model="gpt", grad_accum=1)
    compile_model(model, flags, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    ids = torch.randint(0, 65, (7, 17), generator=torch.Generator().manual_seed(0))
    batches = training.Batches(
        TensorDataset(ids[:, :-1], ids[:, 1:]), 4, torch.device("cpu"), torch.float32
    )

    def train(steps):
        model.train()
        for _ in range(steps):
            loss = F.cross_entropy(model(ids[:4, :-1]).flatten(0, 1), ids[:4, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss.item()

    first = train(1)
    with torch.compiler.set_stance("fail_on_recompile"):
        train(2)
        totals = training.evaluate(model, batches, 0, 1)
        last = train(3)
    assert totals[2] == 7 * 16 and last < first, (totals, first, last)
    model.eval()
    with torch.compiler.set_stance("fail_on_recompile"), torch.no_grad():
        with pytest.raises(RuntimeError, match="Detected recompile"):
            model(ids[:3, :-1])
