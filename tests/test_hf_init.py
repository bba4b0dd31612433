"""--init-from with what a Hugging Face user has: a save_pretrained folder of shards and an index,
read into the README's copy of the scripts with the user's wrapper around a tiny tied,
grouped-query LlamaForCausalLM (its names have the wrapper's ``lm.``, the file has no head)."""

import json
import sys

import pytest
import torch
from conftest import (
    CONTROL_FLOOR,
    Run,
    child_env,
    load_weights,
    relative_difference,
    succeeded,
)
from test_hf_llama import SNIPPET, function_source
from test_template import make_copy

from plumbing import failures, init_from

# The user's model: the Llama inside a wrapper, whose forward returns the logits alone; its TP
# plan is the snippet's, by the wrapper's names.
WRAPPER = '''

class Net(nn.Module):  # the wrapper: lm.model..., lm.lm_head (tied)
    def __init__(self):
        super().__init__()
        self.lm = LlamaForCausalLM(CONFIG)

    def forward(self, ids):
        return self.lm(ids).logits


def tp_plan(model, tp):
    """The Llama's plan, by the wrapper's names."""
    plan = {
        "lm.model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.lm.model.layers)):
        attention, mlp = f"lm.model.layers.{index}.self_attn", f"lm.model.layers.{index}.mlp"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{attention}.{name}"] = ColwiseParallel()
        plan[f"{attention}.o_proj"] = RowwiseParallel()
        plan |= {f"{mlp}.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")}
        plan[f"{mlp}.down_proj"] = RowwiseParallel()
    return plan
'''
TWO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
# SGD at an lr that is 0 in float32: one step that leaves the loaded weights as they are
NO_STEP = ["--optimizer", "sgd", "--momentum", "0", "--weight-decay", "0", "--lr", "1e-300"]
NO_STEP += ["--max-steps", "1", "--no-eval"]


def pretrained(folder, seed=1):
    """The Llama of the snippet's config, from ``seed``, saved as Hugging Face saves it, in shards
    of 50 kB with an index; its state dict."""
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(SNIPPET.parent))
    try:
        from hf_llama import CONFIG
    finally:
        sys.path.pop(0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG)
    model.save_pretrained(folder, max_shard_size="50KB")
    return model.state_dict()


def llama_wrapper_copy(home):
    """The README's copy of the scripts, with init_from.py; the user's wrapper as mymodel.py."""
    scripts = ["train_ddp.py", "train_fsdp.py", "train_pippy.py", "train_tp.py"]
    project, _ = make_copy(home, scripts, ["init_from", "checkpoint_dir"])
    (project / "mymodel.py").write_text(SNIPPET.read_text() + WRAPPER)
    script = (project / "train_tp.py").read_text()
    ours = function_source(script, "tp_plan")
    theirs = function_source(WRAPPER, "tp_plan")
    (project / "train_tp.py").write_text(script.replace(ours, theirs))
    return project


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    project = llama_wrapper_copy(home)
    weights = pretrained(project / "pretrained")
    return project, weights


LOADS = {
    "fsdp": [*TWO, "train_fsdp.py", "--batch-size", "16"],
    "tp": [*TWO, "train_tp.py", "--tp", "2", "--batch-size", "32"],
}


@pytest.mark.parametrize("name", [pytest.param("fsdp"), pytest.param("tp", marks=pytest.mark.slow)])
def test_fsdp_and_tp_start_from_a_sharded_hugging_face_folder(name, llama):
    """FSDP on 2 ranks and TP 2 read the folder of 4 shards, each rank its own rows and columns:
    after a step that moves nothing, the saved weights are bitwise from_pretrained's, the tied
    head the embedding (the file has none)."""
    project, weights = llama
    assert len(list((project / "pretrained").glob("model-*.safetensors"))) > 2
    assert "lm_head.weight" not in init_from.listing(str(project / "pretrained"))[2]
    env = child_env(PYTHONPATH=project)
    for command in [LOADS[name]]:
        run = [*command, *NO_STEP, "--init-from", "pretrained", "--save", f"{name}.pt"]
        run = succeeded(Run(run, env, project))
        assert "initialised the model from pretrained (" in run.output, run.output
        saved = load_weights(project / f"{name}.pt")
        assert saved.keys() == {f"lm.{key}" for key in weights}, name
        for key, tensor in weights.items():
            assert torch.equal(saved[f"lm.{key}"], tensor), (name, key)
    assert_back_in_hugging_face(project, f"{name}.pt", torch.float32, trained=False)


def assert_back_in_hugging_face(project, source, dtype, save=None, trained=True):
    """``python plumbing/consolidate.py SOURCE back --like pretrained`` (the README's copy runs it
    as a plain script): shards and an index with the folder's names, no head; from_pretrained of
    it gives the logits of the Llama with --save's weights (``save``, or ``source``), bitwise."""
    from transformers import LlamaForCausalLM

    command = [sys.executable, "plumbing/consolidate.py", source, "back", "--like", "pretrained"]
    succeeded(Run([*command, "--max-shard-size", "0.05"], child_env(PYTHONPATH=project), project))
    index = json.loads((project / "back" / "model.safetensors.index.json").read_text())
    assert (
        "lm_head.weight" not in index["weight_map"] and len(set(index["weight_map"].values())) > 2
    )
    assert (project / "back" / "config.json").exists()
    back = LlamaForCausalLM.from_pretrained(project / "back", dtype=dtype).eval()
    saved = load_weights(project / (save or source))
    model = LlamaForCausalLM.from_pretrained(project / "pretrained", dtype=dtype).eval()
    model.load_state_dict({name.removeprefix("lm."): t for name, t in saved.items()})
    ids = torch.arange(30).reshape(2, 15) % 64
    with torch.no_grad():  # summation orders may differ in the last bit (2e-16 in fp64)
        logits, expected = back(ids).logits, model(ids).logits
        untrained = LlamaForCausalLM.from_pretrained(project / "pretrained", dtype=dtype)(
            ids
        ).logits
    torch.testing.assert_close(
        logits, expected, rtol=1e-12 if dtype == torch.float64 else 0, atol=0
    )
    if trained:  # the control: from_pretrained's logits before training differ
        assert (untrained - expected).abs().max() > 1e-3
    for name, tensor in model.state_dict().items():  # and the weights are the trained ones
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.slow  # four launches
def test_ten_fp64_steps_from_the_folder_equal_one_process(llama):
    """From the sharded folder, 10 fp64 steps of FSDP on 2 ranks and TP 2 end where one process
    ends; the control, one process from the seed instead, ends far away. The trained weights, from
    --save's file and from the checkpoint, go back to Hugging Face: from_pretrained's logits are
    the script's."""
    project, weights = llama
    env = child_env(PYTHONPATH=project)
    common = ["--precision", "fp64", "--max-steps", "10", "--no-eval", "--checkpoint-every", "10"]
    layouts = {
        "one": [sys.executable, "train_ddp.py", "--batch-size", "64"],
        "fsdp": [*TWO, "train_fsdp.py", "--batch-size", "32", "--checkpoint-dir", "ck"],
        "tp": [*TWO, "train_tp.py", "--tp", "2", "--batch-size", "64"],
    }
    runs = [  # at once, as they share nothing: the waits of one overlap the others' work
        Run(
            [*command, *common, "--init-from", "pretrained", "--save", f"{name}-10.pt"],
            env,
            project,
        )
        for name, command in layouts.items()
    ]
    control = [sys.executable, "train_ddp.py", *common, "--batch-size", "64", "--save", "c.pt"]
    runs.append(Run(control, env, project))
    for run in runs:
        succeeded(run)
    initial = {f"lm.{key}": tensor.double() for key, tensor in weights.items()}
    one = load_weights(project / "one-10.pt")
    for name in ("fsdp", "tp"):
        difference = relative_difference(load_weights(project / f"{name}-10.pt"), one, initial)
        assert difference < 1e-6, (name, difference)
    apart = relative_difference(load_weights(project / "c.pt"), one, initial)
    assert apart > CONTROL_FLOOR, apart
    assert_back_in_hugging_face(project, "fsdp-10.pt", torch.float64)
    assert_back_in_hugging_face(project, "ck", torch.float64, "fsdp-10.pt")  # its checkpoint
    assert not torch.equal(
        load_weights(project / "fsdp-10.pt")["lm.model.norm.weight"].float(),
        weights["model.norm.weight"],
    )


def shapes_of(state):
    return {name: list(tensor.shape) for name, tensor in state.items()}


def test_names_match_with_a_prefix_and_a_tied_head_and_a_misfit_is_one_line(tmp_path):
    """The folder, its index and one shard are read by name: with the wrapper's prefix, the tied
    head filled through the embedding; a missing tensor, a shape and an extra tensor each one line
    naming it, as a folder of no weights and a path that is not there."""
    weights = pretrained(tmp_path / "hf")
    ours = {f"lm.{key}": list(t.shape) for key, t in weights.items()}
    ties = {name: name for name in ours}
    ties["lm.lm_head.weight"] = "lm.model.embed_tokens.weight"
    kind, files, names = init_from.check(str(tmp_path / "hf"), ours, ties)
    assert kind == "safetensors" and len(files) > 2
    assert names["lm.model.norm.weight"][1] == "model.norm.weight"
    assert "lm.lm_head.weight" not in names  # filled as the embedding
    bare = {key: list(t.shape) for key, t in weights.items()}  # no prefix: the same names
    bare_ties = {name: name for name in bare} | {"lm_head.weight": "model.embed_tokens.weight"}
    assert init_from.check(str(tmp_path / "hf"), bare, bare_ties)[2].keys() < bare.keys()
    untied = dict(ties, **{"lm.lm_head.weight": "lm.lm_head.weight"})
    refusals = {  # (ours, ties): the line
        "it has no lm.lm_head.weight": (ours, untied),
        "lm.model.norm.weight is [32] there, [33] here": (
            ours | {"lm.model.norm.weight": [33]},
            ties,
        ),
        "it has model.norm.weight, which this model lacks": (
            {k: v for k, v in ours.items() if k != "lm.model.norm.weight"},
            {k: v for k, v in ties.items() if k != "lm.model.norm.weight"},
        ),
    }
    for line, (shapes, tied) in refusals.items():
        with pytest.raises(failures.UsageError) as error:
            init_from.check(str(tmp_path / "hf"), shapes, tied)
        assert str(error.value) == f"--init-from {tmp_path / 'hf'} does not fit this model: {line}"
    (tmp_path / "empty").mkdir()
    line = "a folder with no model.safetensors, model.safetensors.index.json"
    with pytest.raises(failures.UsageError, match=f"^--init-from {tmp_path / 'empty'}: {line}"):
        init_from.check(str(tmp_path / "empty"), ours, ties)
    line = rf"--init-from: {tmp_path / 'nothing'} cannot be read \(No such file or directory\)"
    with pytest.raises(failures.InputError, match=f"^{line}"):  # the OS's own word
        init_from.check(str(tmp_path / "nothing"), ours, ties)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    assert init_from.check(str(index), ours, ties)[2] == names
