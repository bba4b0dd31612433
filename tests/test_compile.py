"""--compile on the CPU: what could make a compiled step slower than eager, unseen. A graph break
splits the model into pieces run by Python in between; a recompilation compiles again in the middle
of training. Under DDP and FSDP, for BabyCNN and the GPT, no graph break happens, and no
recompilation after the first step: the runs log each one (TORCH_LOGS). The control: the evaluation
after the last step recompiles BabyCNN (no_grad changes a guard), and that line is seen."""

import re

import pytest
from conftest import child_env, python, succeeded

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
        output = succeeded(run).output
        # Step 1 compiles each block's kind of input once (FSDP: the first block's input needs
        # no gradient, the others' do); steps 2 to 20 must run what it compiled.
        later = output.partition("step 1/20")[2].partition("step 20/20")[0]
        assert "step 19/20" in later, output
        assert not RECOMPILES.search(later) and not BREAKS.search(output), (script, model, output)
    evaluation = runs["train_ddp.py", "cnn"].output.partition("step 20/20")[2]
    assert "test accuracy" in evaluation and RECOMPILES.search(evaluation), evaluation
