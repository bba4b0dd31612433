"""A Hugging Face causal LM whose head is tied to its embedding, copied as the README says, through
every script: docs/snippets/hf_llama.py as the user's mymodel.py, its tp_plan() in train_tp.py.

A tied weight used to come apart: the pipeline trained a copy on each stage, each with half the
gradient; parallelize_module gave the embedding and the head a parameter each; fully_shard on the
embedding's block and the head's block made two weights of one. Each script ended with another
model than one process trains, and said nothing."""

import importlib.util
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    CONTROL_FLOOR,
    ROOT,
    Run,
    assert_one_line_error,
    child_env,
    launcher_env,
    load_weights,
    relative_difference,
    succeeded,
)
from test_template import copy_command, make_copy
from torch import nn

from plumbing import failures

SNIPPET = ROOT / "docs" / "snippets" / "hf_llama.py"
EMBEDDING, HEAD = "blocks.0.weight", "blocks.5.lm_head.weight"  # one weight
# Llama's RMSNorm and rotary angles compute in float32 whatever the model's dtype, so runs that
# differ in summation order may round apart there (1e-16 apart measured here; 4e-10 elsewhere);
# far below the untied control, which moves the weights 0.1 to 1 of their step apart.
HF_TOLERANCE = 1e-6


def snippet():
    """docs/snippets/hf_llama.py as a module: the user's Net, Clusters and tp_plan."""
    spec = importlib.util.spec_from_file_location("hf_llama", SNIPPET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def function_source(text, name):
    """The text of top-level function ``name`` in ``text``, up to the next top-level block."""
    start = text.index(f"\ndef {name}(") + 1
    end = re.compile(r"^\S", re.M).search(text, start + 1)  # ^: only where a line starts
    return text[start : end.start() if end else len(text)].rstrip() + "\n"


def llama_copy(home, plan=None):
    """The README's copy of the four scripts with the snippet as mymodel.py, and train_tp.py's
    tp_plan() replaced by the snippet's (or by ``plan``)."""
    scripts = ["train_ddp.py", "train_fsdp.py", "train_pippy.py", "train_tp.py"]
    project, _ = make_copy(home, scripts, ["checkpoint_dir"])  # its --checkpoint-dir
    text = SNIPPET.read_text()
    (project / "mymodel.py").write_text(text)
    script = (project / "train_tp.py").read_text()
    ours = function_source(script, "tp_plan")
    (project / "train_tp.py").write_text(
        script.replace(ours, plan or function_source(text, "tp_plan"))
    )
    return project


@pytest.mark.slow  # seven launches
def test_a_tied_hugging_face_llama_trains_as_one_process_under_every_script(tmp_path):
    """In float64, 20 steps with clipping on: DDP and FSDP on 2 ranks of 32 samples, the pipeline on
    2 stages (the embedding on the first, the head on the last) and TP on 2 ranks each end with
    one process's weights, the tied pair equal in every file; the pipeline's checkpoints hold its
    two copies bitwise equal at steps 10 and 20. The control, the head a copy of the embedding
    instead of the same weight (what the pipeline and FSDP trained before), ends far away. A TP
    plan that splits the embedding but not the head is refused in one line. The pipeline resumes
    one process's checkpoint (its last stage names the head's optimizer state by the embedding's
    name, as one process does) and ends with one process's weights."""
    project = llama_copy(tmp_path / "tied")
    env = child_env(PYTHONPATH=project)
    common = ["--precision", "fp64", "--max-steps", "20", "--no-eval", "--log-every", "10"]
    common += ["--max-grad-norm", "0.05", "--checkpoint-every", "10"]
    python, torchrun = [sys.executable], [sys.executable, "-m", "torch.distributed.run"]
    two = [*torchrun, "--standalone", "--nproc-per-node=2"]
    layouts = {
        "one": [*python, "train_ddp.py"],
        "ddp": [*two, "train_ddp.py", "--batch-size", "32"],
        "fsdp": [*two, "train_fsdp.py", "--batch-size", "32"],
        "pipeline": [*two, "train_pippy.py", "--microbatches", "4"],
        "tp": [*two, "train_tp.py", "--tp", "2"],
    }
    runs = {
        name: Run([*args, *common, "--save", f"{name}.pt", "--checkpoint-dir", name], env, project)
        for name, args in layouts.items()
    }
    untied = llama_copy(tmp_path / "untied")
    with (untied / "mymodel.py").open("a") as f:  # the head a copy of the embedding's weight
        f.write(
            "\n\nclass Net(Net):\n    def __init__(self):\n        super().__init__()\n"
            "        head = self.blocks[-1].lm_head\n"
            "        head.weight = nn.Parameter(self.blocks[0].weight.detach().clone())\n"
        )
    control = Run([*python, "train_ddp.py", *common, "--save", "control.pt"], env, untied)
    plan = function_source(SNIPPET.read_text(), "tp_plan")
    no_head = re.sub(r'\n *f"blocks\.\{last\}\.lm_head".*', "", plan)  # the embedding split alone
    assert no_head != plan
    launch = [arg.replace("train_ddp.py", "train_tp.py") for arg in copy_command()[:3]]
    unlike = llama_copy(tmp_path / "unlike", no_head)  # through its launcher, as a user runs it
    unlike = Run(launch, launcher_env(NPROC_PER_NODE=2, PYTHONPATH=unlike), unlike)

    for run in runs.values():
        succeeded(run)
    assert "2 stages: blocks [[0, 1, 2], [3, 4, 5]]" in runs["pipeline"].output
    assert "norm" in runs["one"].output  # clipping is logged
    torch.manual_seed(0)
    initial = snippet().Net().double().state_dict()
    weights = {name: load_weights(project / f"{name}.pt") for name in runs}
    for name, saved in weights.items():
        assert torch.equal(saved[EMBEDDING], saved[HEAD]), name
        difference = relative_difference(saved, weights["one"], initial)
        assert difference < HF_TOLERANCE, (name, difference)
    for name in ("one", "pipeline"):  # one tensor under both names, as the model holds it
        saved = weights[name]
        assert saved[EMBEDDING].data_ptr() == saved[HEAD].data_ptr(), name
    for step in (10, 20):  # each stage's own copy, as it saved it
        state = checkpoint_model(project / "pipeline" / f"step-{step}")
        assert torch.equal(state[EMBEDDING], state[HEAD]), step
    # Another strategy's checkpoint: the pipeline goes on from one process's step 10, to its end.
    shutil.copytree(project / "one" / "step-10", project / "resumed" / "step-10")
    resumed = [*layouts["pipeline"], *common, "--save", "resumed.pt", "--checkpoint-dir", "resumed"]
    resumed = succeeded(Run(resumed, env, project))
    assert "resumed from resumed/step-10" in resumed.output, resumed.output
    weights["resumed"] = load_weights(project / "resumed.pt")
    assert relative_difference(weights["resumed"], weights["one"], initial) < HF_TOLERANCE
    succeeded(control)
    apart = relative_difference(load_weights(untied / "control.pt"), weights["one"], initial)
    assert apart > CONTROL_FLOOR, apart
    assert_one_line_error(
        unlike.wait(), f"{EMBEDDING} and {HEAD} are one weight (tied), but the TP plan splits them"
    )


def checkpoint_model(directory):
    """The model's tensors in a DCP checkpoint, by name, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, directory.parent / f"{directory.name}.pt")
    state = torch.load(directory.parent / f"{directory.name}.pt", weights_only=True)
    return state["model"]


def test_one_rule_finds_the_tied_weights_every_script_keeps_one():
    """plumbing/parts.py's tied_names, the one finder that FSDP's units, TP's retie, the
    pipeline's copies and the meta build's to_empty call: each shared weight's names, in the
    model's order (a Hugging Face Llama's, the GPT's); none in an untied model (BabyCNN)."""
    from models import GPT, BabyCNN
    from plumbing.parts import tied_names

    torch.manual_seed(0)
    assert tied_names(snippet().Net()) == [[EMBEDDING, HEAD]]
    gpt = GPT()
    last = len(gpt.blocks) - 1
    assert tied_names(gpt) == [["blocks.0.tokens.weight", f"blocks.{last}.out.weight"]]
    assert tied_names(BabyCNN()) == []


def test_fsdp_shards_a_tied_weight_in_a_unit_around_both_its_modules():
    """fully_shard on the embedding and on the head made two weights of one: neither is a unit
    now, and the blocks around both hold the tied weight; the decoder layers stay units."""
    from plumbing.parts import shard_units

    torch.manual_seed(0)
    model = snippet().Net()
    units, words = shard_units(model)
    names = [name for _, name in units]
    assert names == ["1", "2", "3", "4", "blocks"], names
    assert words.startswith("5 units"), words


def test_the_pipeline_finds_the_weights_its_stages_share():
    """The tied pair, found on the whole model before the cut: on the first stage's rank the copy
    that the gradient norm counts, on the last stage's the one it leaves out; none when one stage
    holds both."""
    from train_pippy import tied_weights

    torch.manual_seed(0)
    model = snippet().Net()
    weight = model.blocks[0].weight
    cut = [[0, 1, 2], [3, 4, 5]]
    ((names, like, copy, counted),) = tied_weights(model, cut, [0])
    assert names == [EMBEDDING, HEAD] and copy is weight and counted
    assert like.shape == weight.shape and like.device.type == "meta"
    ((_, _, copy, counted),) = tied_weights(model, cut, [1])
    assert copy is weight and not counted
    assert tied_weights(model, [[0, 1, 2, 3, 4, 5]], [0]) == []
    middle = tied_weights(model, [[0], [1, 2, 3, 4], [5]], [1])  # no copy on the middle stage
    assert [(w.copy, w.counted) for w in middle] == [(None, False)]


class Attention(nn.Module):  # GPT-2's layout: query, key and value in one c_attn
    def __init__(self, fused):
        super().__init__()
        self.c_attn = fused


def test_a_tp_plan_is_refused_in_one_line_where_it_does_not_fit_the_model():
    """A plan is checked against the model before it splits anything: a module it names that the
    model lacks, a Hugging Face Conv1D (ColwiseParallel takes nn.Linear and nn.Embedding only), a
    fused query-key-value, and the GPT's plan on another model are each a UsageError naming the
    module and the fix. The control: the Llama's plan on the Llama passes."""
    from transformers.pytorch_utils import Conv1D

    from train_tp import checked, tp_plan

    llama = snippet()
    torch.manual_seed(0)
    assert len(checked(llama.tp_plan, llama.Net(), 2)) == 2 + 4 * 7
    with pytest.raises(failures.UsageError, match=r"^tp_plan\(\) does not fit your model \("):
        checked(tp_plan, llama.Net(), 2)  # the GPT's plan
    with pytest.raises(failures.UsageError, match=r"--tp 4 must divide the Llama's 4 query"):
        checked(llama.tp_plan, llama.Net(), 4)  # 2 key/value heads
    refusals = (
        (nn.Linear(8, 24), {"missing": None}, "names missing, which your model does not have"),
        (Conv1D(24, 8), {"c_attn": None}, "splits c_attn, a Conv1D, but ColwiseParallel and"),
        (nn.Linear(8, 24), {"c_attn": None}, "splits c_attn, which computes query, key and"),
    )
    from torch.distributed.tensor.parallel import ColwiseParallel

    for fused, plan, error in refusals:
        plan = {name: ColwiseParallel() for name in plan}
        with pytest.raises(failures.UsageError, match=re.escape(error)):
            checked(lambda model, tp, plan=plan: plan, Attention(fused), 2)
