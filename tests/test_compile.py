"""--compile on the CPU: what could make a compiled step slower than eager, unseen. A graph break
splits the model into pieces run by Python in between; a recompilation compiles again in the middle
of training. Under DDP and FSDP, for BabyCNN and the GPT, no graph break happens, and no
recompilation after the first step: the runs log each one (TORCH_LOGS); the evaluation, eager, adds
none. And the GPT compiled as train_ddp.py compiles it trains, evaluates and trains on under torch's
fail_on_recompile stance; its control: a no_grad forward outside the evaluation's eager stance
fails on recompiling."""

import argparse
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import child_env, python, succeeded
from torch.utils.data import TensorDataset

RECOMPILES = re.compile(r"\[__recompiles\] Recompiling function")
BREAKS = re.compile(r"\[__graph_breaks\] Graph break")


@pytest.mark.slow  # four compiles, half a minute each
def test_no_graph_break_and_no_recompilation_in_a_compiled_training_step(tmp_path):
    layouts = {
        ("train_ddp.py", "cnn"): [],  # evaluated at the end: the control
        ("train_ddp.py", "gpt"): ["--no-eval"],
        ("train_fsdp.py", "cnn"): ["--no-eval"],
        ("train_fsdp.py", "gpt"): ["--no-eval"],
    }
    runs = {}
    for (script, model), flags in layouts.items():
        # A cache of its own: torch 2.14's inductor cache, filled under one ATEN_CPU_CAPABILITY,
        # segfaults when read under another (tests/test_ddp.py).
        cache = tmp_path / f"{script}-{model}"
        env = child_env(TORCH_LOGS="recompiles,graph_breaks", TORCHINDUCTOR_CACHE_DIR=cache)
        runs[script, model] = python(
            script, "--model", model, "--compile", "--max-steps", "20", "--log-every", "1",
            *flags, env=env, fork=False,  # a new process: torch reads TORCH_LOGS on import
        )  # fmt: skip
    for (script, model), run in runs.items():
        output = succeeded(run.wait(480)).output  # four compiles at once: minutes on a busy CPU
        # Step 1 compiles each block's kind of input once (FSDP: the first block's input needs
        # no gradient, the others' do); steps 2 to 20 must run what it compiled.
        later = output.partition("step 1/20")[2].partition("step 20/20")[0]
        assert "step 19/20" in later, output
        assert not RECOMPILES.search(later) and not BREAKS.search(output), (script, model, output)
    evaluation = runs["train_ddp.py", "cnn"].output.partition("step 20/20")[2]
    assert "test accuracy" in evaluation and not RECOMPILES.search(evaluation), evaluation


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
