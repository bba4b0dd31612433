"""docs/transformer.md's picture of sequence parallelism: each row's shape and placement is what
train_tp.py's tp_plan() gives rank 0 of 2 in one forward of the GPT at batch 16, recorded by
forward hooks on block 1. Marked slow and pages: it checks a figure a page quotes."""

import json
import re

import pytest
from conftest import ROOT, child_env, succeeded, torchrun

RECORD = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
import train_tp
from models.gpt import GPT

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
model = GPT()
parallelize_module(model, mesh["tp"], train_tp.tp_plan(model, 2))
seen = {}

def layout(t):
    if isinstance(t, DTensor):
        return list(t.to_local().shape), type(t.placements[0]).__name__
    return list(t.shape), None

def record(name):
    def hook(module, inputs, output):
        seen[name] = (layout(inputs[0]), layout(output))
    return hook

block = model.blocks[1]
for name in ("attn_norm", "attn.qkv", "attn.proj", "attn"):
    block.get_submodule(name).register_forward_hook(record(name))
model(torch.randint(0, 65, (16, 64)))
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(seen))
dist.destroy_process_group()
"""


def diagram():
    """{first words of a row: (shape, placement or None)} of the page's ```text picture."""
    text = (ROOT / "docs" / "transformer.md").read_text()
    block = re.search(r"Rank 0's attention.*?```text\n(.*?)```", text, re.S).group(1)
    rows = {}
    for line in block.splitlines():
        name, shape, note = re.fullmatch(r"(.+?)\s{2,}(\d+×\d+×\d+)\s+(.*)", line).groups()
        placement = re.match(r"(Shard|Replicate|Partial)\(", note)
        rows[name] = ([int(n) for n in shape.split("×")], placement and placement.group(1))
    return rows


@pytest.mark.slow
@pytest.mark.pages
def test_the_sequence_parallel_picture_has_the_scripts_shapes(tmp_path):
    script, out = tmp_path / "record.py", tmp_path / "seen.json"
    script.write_text(RECORD)
    succeeded(torchrun(script, 2, str(out), env=child_env()))
    seen = json.loads(out.read_text())
    (norm_in, norm_out), (query_in, query_out) = seen["attn_norm"], seen["attn.qkv"]
    proj_in, proj_out = seen["attn.proj"]
    assert norm_in == norm_out, seen
    recorded = {
        "stream, attn_norm": tuple(norm_out),
        "all-gather": tuple(query_in),
        "qkv": (query_out[0], None),
        # the row-wise Linear's local product, before the reduce-scatter: proj_in's rows, n_embd
        "proj": (proj_in[0][:2] + proj_out[0][2:], "Partial"),
        "reduce-scatter": tuple(proj_out),
    }
    page = {name: tuple(value) for name, value in diagram().items()}
    assert page == recorded, f"the page: {page}\nthe script: {recorded}"
    assert seen["attn"][1] == proj_out, seen  # what the attention adds to the stream
