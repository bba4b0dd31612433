"""A proof on the CPU that FSDP and TP start from pretrained weights with no rank holding the model
whole: each worker's data segment (RLIMIT_DATA: the heap and private memory, not the mapped file)
is limited to what torch itself needs, measured, plus 0.87 of the model's fp32 bytes. FSDP x2 and
TP x2 read a sharded Hugging Face folder and train; the same copy built whole fails. Measured here
(VmData above torch's 937 MB, model 411 MB): FSDP 305 MB, TP 286 MB, built whole 423 MB."""

import json
import re
import sys
import time

import pytest
import torch
from conftest import Run, child_env, mnist_args, python, succeeded, torchrun, worker_pids
from test_hf_init import WRAPPER, llama_wrapper_copy

# The user's model: a Llama of 103 M parameters (411 MB in fp32; 32 thin layers, so that FSDP's
# gathered unit is small beside the model; 8 heads, 4 key/value heads, tied) of which only the
# norms train, as in a fine-tune that freezes the rest: the gradients and optimizer state are
# small, so what the limit bounds is the weights. LLAMA_SIZE=tiny: the snippet's, to measure what
# torch needs beside the model.
BIG = """

import os

BIG = LlamaConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=32,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=16,
    tie_word_embeddings=True,
    attn_implementation="sdpa",
)


class Net(Net):
    def __init__(self):
        nn.Module.__init__(self)
        self.lm = LlamaForCausalLM(CONFIG if os.environ.get("LLAMA_SIZE") == "tiny" else BIG)
        for name, parameter in self.named_parameters():
            parameter.requires_grad_("norm" in name)
"""
# glibc's malloc returns each large block when freed (its threshold else grows to 32 MB, and freed
# blocks stay in the heap, counted): VmData is then what the process holds.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
TWO = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
COMMON = ["--max-steps", "2", "--no-eval", "--batch-size", "2", "--optimizer", "sgd"]


def data_bytes(pid):
    """VmData of ``pid``: what RLIMIT_DATA bounds."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def peak_data(run):
    """The highest VmData of any of ``run``'s workers, polled until it ends."""
    peak = 0
    while run.process.poll() is None:
        for pid in worker_pids(run.process.pid).values():
            try:
                peak = max(peak, data_bytes(pid))
            except (OSError, StopIteration):
                pass
        time.sleep(0.02)
    return peak


@pytest.mark.slow  # a 411 MB model saved, four launches
def test_fsdp_and_tp_start_from_a_sharded_folder_in_less_memory_than_the_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    project = llama_wrapper_copy(tmp_path)
    with (project / "mymodel.py").open("a") as f:
        f.write(BIG)
    assert WRAPPER in (project / "mymodel.py").read_text()
    namespace = {"LlamaConfig": LlamaConfig}
    exec(BIG.split("\n\nclass Net")[0], namespace)
    model = LlamaForCausalLM(namespace["BIG"])
    model_bytes = sum(p.nbytes for p in model.parameters())
    model.save_pretrained(project / "pretrained", max_shard_size="100MB")
    del model
    fsdp = [*TWO, "train_fsdp.py", *COMMON, "--init-from", "pretrained"]
    # torch's own need: the same run with the tiny Llama, every worker's highest VmData
    tiny = Run(
        [*TWO, "train_fsdp.py", *COMMON],
        child_env(PYTHONPATH=project, LLAMA_SIZE="tiny", **MALLOC),
        project,
    )
    base = peak_data(tiny)
    succeeded(tiny)
    limit = base + int(0.87 * model_bytes)
    cap = ["prlimit", f"--data={limit}:{limit}"]
    env = child_env(PYTHONPATH=project, **MALLOC)
    runs = {
        "fsdp": [*cap, *fsdp],
        "tp": [*cap, *TWO, "train_tp.py", *COMMON, "--tp", "2", "--init-from", "pretrained"],
    }
    for name, command in runs.items():
        run = succeeded(Run(command, env, project))
        assert "built on meta, each rank's part read from --init-from" in run.output, run.output
        line = next(x for x in run.output.splitlines() if "each rank's peak memory" in x)
        print(name, line, f"limit {limit / 1e6:.0f} MB, model {model_bytes / 1e6:.0f} MB")
    # The control: the same copy built whole (no --init-from, no reset_parameters) under the limit
    whole = Run([*cap, *TWO, "train_fsdp.py", *COMMON], env, project).wait()
    assert whole.returncode != 0, whole.output
    assert "memory" in whole.output.lower(), whole.output


def held_and_split(output):
    """Each rank's parameters once filled (MB, from the script's line) and the stages' blocks."""
    line = next(x for x in output.splitlines() if x.startswith("each rank's parameters"))
    held = [float(mb) for mb in line.split(": ")[1].split(" MB")[0].split(", ")]
    return held, json.loads(re.search(r"blocks (\[\[.*?\]\])", output).group(1))


def test_a_pipeline_rank_allocates_only_its_stages_blocks(mnist_dir):
    """train_pippy.py builds BabyCNN on meta: on 2 ranks each allocates the parameters of its own
    stage's blocks, to the kilobyte, not the whole model (1.04 and 6.40 MB of 7.44 at width 8);
    that they are filled as a whole build fills them, tests/test_pippy.py's equivalences hold.
    The control: one process, one stage, allocates the whole model, measured the same way."""
    from models import BabyCNN

    with torch.device("meta"):
        blocks = BabyCNN(width=8).blocks
    sizes = [sum(p.nbytes for p in block.parameters()) / 1e6 for block in blocks]
    common = ["--width", "8", "--max-steps", "1", "--no-eval", "--batch-size", "8"]
    common += ["--microbatches", "2", *mnist_args(mnist_dir)]
    env = child_env(OMP_NUM_THREADS="1")
    two = succeeded(torchrun("train_pippy.py", 2, *common, env=env))
    one = succeeded(python("train_pippy.py", *common, env=env))
    assert "built on meta, each rank's part filled from the seed" in two.output, two.output
    held, split = held_and_split(two.output)
    assert len(split) == 2 and held == pytest.approx(
        [sum(sizes[b] for b in stage) for stage in split], abs=5e-4
    ), (held, split, sizes)
    assert max(held) < 0.9 * sum(sizes), (held, sizes)
    assert held_and_split(one.output) == (pytest.approx([sum(sizes)], abs=5e-4), [[0, 1, 2, 3]])
