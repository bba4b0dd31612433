"""Count a train_tp.py step's collectives and each rank's state bytes, against their predictions.

It counts the collectives of one train_tp.py step with CommDebugMode, against the prediction
docs/parallelism.md makes, and each rank's bytes of parameters and optimizer state against the whole
model's / (dp x tp).

    torchrun --standalone --nproc-per-node=2 benchmarks/tp_collectives.py            # tp 2, dp 1
    torchrun --standalone --nproc-per-node=4 benchmarks/tp_collectives.py --tp 2     # tp 2, dp 2
    torchrun --standalone --nproc-per-node=4 benchmarks/tp_collectives.py --model gpt  # tp_plan()

The prediction, for BabyCNN's 4 blocks (3 conv blocks of two convolutions, a head of a convolution
and the classifier), each split as a column-wise/row-wise pair: in forward, one all-reduce per pair
(4); in backward, one per pair whose input needs a gradient (3: not the first, whose input is the
images). FSDP over dp > 1: an all-gather per block in forward (4) and again in backward for all but
the last (3), which keeps its weights; a reduce-scatter per block (4).

The GPT's (--model gpt: tp_plan(), L = 4 blocks), tp > 1. In forward, a reduce-scatter into the
sequence split after each row-wise layer: the two embeddings and each block's two projections
(2L + 2); an all-gather of the sequence before each column-wise layer: each block's attention and
MLP, and the head (2L + 1); loss_parallel()'s 3 all-reduces (the logits' max, the sum of their
exponentials, the target's logit, each over the vocabulary's split). In backward, each becomes the
other: an all-gather for each reduce-scatter (2L + 2; the embeddings' too, whose weights need the
whole gradient) and a reduce-scatter for each all-gather (2L + 1); and an all-reduce for each
norm's weight (2L + 1; no biases): a norm works on 1/tp of the positions, so the gradient of its
replicated weight is a partial sum (FSDP reduces it before its own reduce-scatter). FSDP over
dp > 1: L + 1 units (L blocks, and the root, which holds the embedding and the head that share the
token table), as for BabyCNN's blocks. Rank 0 prints one JSON line.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

from models import GPT, BabyCNN  # noqa: E402
from plumbing import metrics  # noqa: E402
from train_tp import parallelize  # noqa: E402

NAMES = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
}


def counted(comm):
    """{collective: calls} of a CommDebugMode, c10d's and functional collectives' names merged."""
    counts = {}
    for op, calls in comm.get_comm_counts().items():
        name = NAMES.get(str(op).split(".")[-1], str(op))
        counts[name] = counts.get(name, 0) + calls
    return counts


def predict(model, dp, tp):
    """The docstring's prediction: ({collective: calls} in forward, the same in backward)."""
    forward, backward = {}, {}
    if model == "gpt":
        blocks, layers = 5, 4  # FSDP's units: 4 blocks, the root (the embedding and the head)
        if tp > 1:
            forward = {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 2}
            forward["all_reduce"] = 3
            backward = {"all_gather": 2 * layers + 2, "reduce_scatter": 2 * layers + 1}
            backward["all_reduce"] = 2 * layers + 1
    else:
        blocks = 4
        forward, backward = {"all_reduce": 4}, {"all_reduce": 3}
    if dp > 1:  # FSDP's: gathered in forward, again in backward but the last, reduce-scattered
        for counts, gathers in ((forward, blocks), (backward, blocks - 1)):
            counts["all_gather"] = counts.get("all_gather", 0) + gathers
        backward["reduce_scatter"] = backward.get("reduce_scatter", 0) + blocks
    return forward, backward


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    dp = world_size // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    try:
        torch.manual_seed(0)
        if args.model == "gpt":  # models.build's: 4 blocks, 65 characters, 64 positions
            model = GPT(65, 64)
            images, labels = torch.randint(0, 65, (2, 2, 64)).unbind()
        else:
            model = BabyCNN(width=args.width)
            images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
        whole = sum(p.numel() for p in model.parameters())
        flags = argparse.Namespace(precision="fp32", model=args.model, tp=args.tp)
        parallelize(model, flags, mesh)  # the script's own
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad()
            with loss_parallel(), CommDebugMode() as forward:  # as train_tp.py's loss
                loss = F.cross_entropy(model(images).flatten(0, -2), labels.flatten())
            with loss_parallel(), CommDebugMode() as backward:
                loss.backward()
            optimizer.step()
            return counted(forward), counted(backward)

        step()  # the first step also sets FSDP up
        forward, backward = step()
        state = metrics.memory(model, optimizer, torch.device("cpu"))["state_bytes"]
        predicted_forward, predicted_backward = predict(args.model, dp, args.tp)
        # AdamW in fp32: a parameter's 4 bytes of weight, 4 of gradient and 8 of moments, plus the
        # step counters
        states = [None] * world_size
        dist.all_gather_object(states, state)
        if dist.get_rank() == 0:
            print(
                json.dumps(
                    {
                        "model": args.model,
                        "dp": dp,
                        "tp": args.tp,
                        "forward": forward,
                        "predicted_forward": predicted_forward,
                        "backward": backward,
                        "predicted_backward": predicted_backward,
                        "state_bytes": states,
                        "whole_model_state_bytes": 16 * whole,
                        "whole_over_dp_tp": 16 * whole / (dp * args.tp),
                    }
                )
            )
    finally:
        # as train_tp.py: let go of the mesh's groups before shutdown
        getattr(mesh, "_pg_registry", {}).clear()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
