"""Measure the activations forward keeps for backward, per transformer block, on a CPU.

    python docs/activation_memory.py     # the GPT's block and a Llama block: seconds

Autograd keeps, for backward, the tensors each operation saves. torch.autograd.graph's
saved_tensors_hooks sees each one as forward saves it: this script counts their bytes, each
storage once (q, k and v are views of the one qkv projection's output), leaving out the parameters
(the training state, not activations). It runs one block's forward at a time:

- the GPT's block (models/gpt.py) at the scripts' shapes, batch 16 of 64 positions, fp32, and
  at other batches, positions and widths: the bytes are a multiple of the tokens, linear in the
  width, written as floats per token per unit of width (the "coefficient");
- the same block under activation checkpointing (torch.utils.checkpoint): only its input is kept;
- the same block split by train_tp.py's tp_plan() (TP with sequence parallelism) on 2 gloo
  processes under torchrun: what each rank keeps of block 1, its DTensors' local parts;
- a Hugging Face LlamaDecoderLayer in bf16, at five small shapes that separate the terms of the
  width C, the MLP's width H, the key/value width C_kv and the heads: its bytes per token,
  a·C + b·H + c·C_kv + e·heads + d. The worked case of Llama-3-8B's shapes uses them.

Prints a summary; writes JSON to --out (default docs/results/activation_memory.json).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from models.gpt import Block  # noqa: E402

OUT = ROOT / "docs" / "results" / "activation_memory.json"
# Llama-3-8B (its config.json): width, MLP width, heads, key/value heads, layers, vocabulary
LLAMA_8B = {"C": 4096, "H": 14336, "heads": 32, "kv_heads": 8, "layers": 32, "vocab": 128256}


def saved_bytes(forward, params, counting=lambda: True):
    """Bytes of the tensors ``forward()`` saves for backward, each storage once, less params'
    (of a DTensor: its local part), while ``counting()``."""
    skip = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(tensor):
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        if counting() and storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def gpt_block(batch, positions, width, heads=4, checkpointing=False):
    """Bytes one GPT block keeps for backward, fp32, dropout 0 (the GPT's default)."""
    torch.manual_seed(0)
    block = Block(width, heads, 0.0)
    x = torch.randn(batch, positions, width, requires_grad=True)

    def forward():
        if checkpointing:
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return block(x)

    return saved_bytes(forward, block.parameters())


def tp_worker(out):
    """Under torchrun: the GPT split by train_tp.py's tp_plan() over all ranks (gloo); each rank
    writes the bytes it keeps for backward in block 1 (batch 16 of 64 positions, fp32)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from models.gpt import GPT
    from train_tp import tp_plan

    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), tp_plan(model, world_size))
    inside = []
    block = model.blocks[1]
    block.register_forward_pre_hook(lambda module, args: inside.append(True))
    block.register_forward_hook(lambda module, args, output: inside.clear())
    ids = torch.randint(0, 65, (16, 64))
    kept = saved_bytes(lambda: model(ids), model.parameters(), lambda: bool(inside))
    sizes = [None] * world_size
    dist.all_gather_object(sizes, kept)  # collective
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(sizes))
    dist.barrier()  # collective: neither rank tears its pairs down while the other still uses them
    dist.destroy_process_group()


def gpt_block_tp(world_size=2):
    """Bytes each of ``world_size`` TP ranks keeps of one GPT block, from tp_worker()."""
    with tempfile.TemporaryDirectory(prefix="activations-") as folder:
        out = Path(folder) / "tp.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
            __file__,
            "--tp-worker",
            str(out),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode:
            raise SystemExit(
                f"{' '.join(command)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def llama_block(tokens, width, mlp, heads, kv_heads):
    """Bytes per token one Hugging Face LlamaDecoderLayer keeps for backward, bf16, sdpa."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=mlp,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(1, tokens, width, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(tokens).unsqueeze(0)
    # the rotary angles' cos and sin: the model's, computed once for all its layers: left out
    rotary = LlamaRotaryEmbedding(config)(x, position_ids)
    forward = lambda: layer(x, position_embeddings=rotary, position_ids=position_ids)  # noqa: E731
    return saved_bytes(forward, [*layer.parameters(), *rotary]) / tokens


def llama_params():
    """Llama-3-8B's parameters, from its shapes: the embedding and the untied head, each layer's
    attention (query and output C x C, key and value C x C_kv), MLP (3 x C x H) and 2 norms, and
    the final norm: 8,030,261,248."""
    m = LLAMA_8B
    C, H, L = m["C"], m["H"], m["layers"]
    kv = C // m["heads"] * m["kv_heads"]
    return 2 * m["vocab"] * C + C + L * (2 * C * C + 2 * C * kv + 3 * C * H + 2 * C)


def worked_case(a, b, c, e, d, gpus=8, sequence=4096, gpu_bytes=80e9):
    """Llama-3-8B on 8 GPUs at 4k context: the state and the activations a GPU holds, per layout
    (bytes), and the sequences (a microbatch's, for the pipeline) that fit beside the state. State:
    16 bytes a parameter (fp32 weights, gradients, AdamW's two moments). Left out: the logits,
    the gathered weights, the allocator's slack."""
    m = LLAMA_8B
    C, H, L = m["C"], m["H"], m["layers"]
    kv = C // m["heads"] * m["kv_heads"]
    params = llama_params()
    layer = sequence * (a * C + b * H + c * kv + e * m["heads"] + d)  # a layer, a sequence
    stream = sequence * C * 2  # a block's input, bf16: what checkpointing keeps
    # TP + SP on t ranks: torch keeps the two gathered norm outputs whole (2·C a token, bf16)
    whole = 2 * stream
    layouts = {
        "DDP": (16 * params, L * layer),
        f"FSDP {gpus}": (16 * params / gpus, L * layer),
        f"FSDP {gpus} + checkpointing": (16 * params / gpus, L * stream + layer),
        f"TP {gpus} + SP": (16 * params / gpus, L * (whole + (layer - whole) / gpus)),
        # 1F1B: the first of p stages holds p microbatches of its L/p layers: L layers' worth
        f"{gpus} stages, 1F1B": (16 * params / gpus, gpus * (L // gpus) * layer),
    }
    return {
        **m,
        "C_kv": kv,
        "params": params,
        "sequence": sequence,
        "layer": layer,
        "gpu_bytes": gpu_bytes,
        "layouts": {
            k: {"state": s, "sequence": act, "fit": max(0, int((gpu_bytes - s) // act))}
            for k, (s, act) in layouts.items()
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--tp-worker", metavar="OUT", help=argparse.SUPPRESS)  # under torchrun
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tp_worker:
        return tp_worker(args.tp_worker)

    shapes = [(16, 64, 128), (8, 64, 128), (16, 32, 128), (16, 64, 256)]  # batch, positions, C
    gpt = [
        {"batch": b, "positions": t, "width": c, "bytes": gpt_block(b, t, c)} for b, t, c in shapes
    ]
    for row in gpt:  # floats a token, per unit of width
        row["coefficient"] = row["bytes"] / 4 / (row["batch"] * row["positions"] * row["width"])
    checkpointed = gpt_block(16, 64, 128, checkpointing=True)
    tp_ranks = gpt_block_tp()

    # five shapes, each a step from the first (C_kv = 64, heads of 32), to tell the terms apart
    base = {"width": 256, "mlp": 896, "heads": 8, "kv_heads": 2}
    shapes = [
        base,
        {**base, "mlp": 1792},  # H + 896
        {**base, "kv_heads": 4},  # C_kv + 64
        {**base, "heads": 16, "kv_heads": 4},  # heads + 8 (of 16: C_kv stays 64)
        {**base, "width": 512},  # C + 256, and heads of 64: C_kv + 64
    ]
    per_token = [llama_block(64, **shape) for shape in shapes]
    b = (per_token[1] - per_token[0]) / 896
    c = (per_token[2] - per_token[0]) / 64
    e = (per_token[3] - per_token[0]) / 8
    a = (per_token[4] - per_token[0] - c * 64) / 256
    d = per_token[0] - a * 256 - b * 896 - c * 64 - e * 8
    law = {"a": a, "b": b, "c": c, "e": e, "d": d}
    llama = {"shapes": shapes, "bytes_per_token": per_token, **law}

    results = {
        "gpt": gpt,
        "gpt_checkpointed_bytes": checkpointed,
        "gpt_tp_sp_bytes": tp_ranks,
        "llama": llama,
        "llama_8b": worked_case(**law),
    }
    for row in gpt:
        print(
            f"GPT block, batch {row['batch']}, {row['positions']} positions, width {row['width']}: "
            f"{row['bytes']:,} bytes, {row['coefficient']:g} floats a token per unit of width"
        )
    print(f"GPT block checkpointed (16, 64, 128): {checkpointed:,} bytes")
    print(f"GPT block, TP + SP on 2 ranks (16, 64, 128): {tp_ranks} bytes a rank")
    print(f"Llama block, bytes a token: {a:g}·C + {b:g}·H + {c:g}·C_kv + {e:g}·heads + {d:g}")
    case = results["llama_8b"]
    print(f"Llama-3-8B, one layer, one sequence of 4,096: {case['layer'] / 1e6:,.0f} MB")
    for name, row in case["layouts"].items():
        print(
            f"  {name}: state {row['state'] / 1e9:.1f} GB, "
            f"a sequence {row['sequence'] / 1e9:.2f} GB"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
