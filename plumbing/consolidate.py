"""python -m plumbing.consolidate CHECKPOINT_DIR OUT.pt: a checkpoint's model as one file.

CHECKPOINT_DIR is a step-<N> directory, or a --checkpoint-dir, whose newest step-<N> is taken (the
line printed says which). Whichever script and world size wrote it (DDP, FSDP's shards, pipeline
stages, TP x FSDP's DTensors), OUT.pt holds what --save writes: the model's full state dict, for
model.load_state_dict(torch.load("OUT.pt", weights_only=True)). One process, no process group, no
GPU. A checkpoint that fails its SHA-256s, or a directory with none, is one line, exit code 2.
"""

import argparse
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plumbing.checkpoint_dir import complete, verify
from plumbing.checkpoints import write_atomically
from plumbing.failures import UsageError

PREFIX = "model."  # Checkpointer.save's {"model": ..., "optimizer": ..., "rng": ...}


def newest(directory):
    """``directory`` if it is a checkpoint (it has checkpoint.json), else its newest step-<N>."""
    if not os.path.isdir(directory):
        raise UsageError(f"{directory} is not a directory: give a step-<N> or a --checkpoint-dir")
    if os.path.exists(os.path.join(directory, "checkpoint.json")):
        return directory
    if not (steps := complete(directory)):
        raise UsageError(
            f"{directory} is not a checkpoint: it has no checkpoint.json and no step-<N>"
        )
    return os.path.join(directory, steps[-1])


def consolidate(directory, out):
    """Write the model of ``directory`` (see newest) to ``out``; return a line that says what."""
    path = newest(directory)
    info, problem = verify(path)  # each file's size and SHA-256
    if problem:  # DCP has no checksum: it would read damaged bytes as weights
        raise UsageError(f"checkpoint {path} is damaged ({problem}): nothing was written")
    metadata, tensors = dcp.FileSystemReader(path).read_metadata(), {}
    saved = metadata.state_dict_metadata
    # The model's entries only, each allocated once at full size: DCP copies every rank's part
    # (a shard, a stage's) into place. In DCP's order of the ranks' names (planner_data, last rank
    # first): the model's, as --save's, where each rank holds every name (DDP, FSDP, TP); a
    # pipeline's last stage comes first.
    for key in dict.fromkeys([*(metadata.planner_data or {}), *saved]):
        if key.startswith(PREFIX) and key in saved:
            if not isinstance(saved[key], TensorStorageMetadata):
                raise UsageError(f"checkpoint {path}: {key} is not a tensor, as --save's are")
            tensors[key[len(PREFIX) :]] = torch.empty(
                saved[key].size, dtype=saved[key].properties.dtype
            )
    if not tensors:
        raise UsageError(f"checkpoint {path} holds no {PREFIX}* tensors: not one of these scripts'")
    state = {"model": tensors}
    with warnings.catch_warnings():  # one process, no group: as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)  # one process: no collective
    # As --save, not by save_on_rank_0: its finite check holds temporaries up to 3 x the largest
    # tensor, and Checkpointer.save saved finite ones.
    size = sum(t.nbytes for t in tensors.values())
    write_atomically(out, lambda file: torch.save(state["model"], file), size)
    return (
        f"wrote {out}: the model of {path} (step {info['step']}, saved by "
        f"{info['layout']['world_size']} rank(s)), {len(tensors)} tensors, {size / 1e6:.1f} MB"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m plumbing.consolidate", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a step-<N> directory, or a --checkpoint-dir (its newest step-<N>)",
    )
    parser.add_argument("out", metavar="OUT.pt", help="the file to write (replaced atomically)")
    args = parser.parse_args(argv)
    try:
        print(consolidate(args.checkpoint, args.out))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
