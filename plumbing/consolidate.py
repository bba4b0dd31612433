"""python plumbing/consolidate.py CHECKPOINT_DIR OUT.pt: a checkpoint's model as one file.

CHECKPOINT_DIR is a step-<N> directory, or a --checkpoint-dir, whose newest step-<N> is taken (the
line printed says which). Whichever script and world size wrote it (DDP, FSDP's shards, pipeline
stages, TP x FSDP's DTensors), OUT.pt holds what --save writes: the model's full state dict, for
model.load_state_dict(torch.load("OUT.pt", weights_only=True)). One process, no process group, no
GPU. A checkpoint that fails its checksums, or a directory with none, is one line, exit code 2.

Back to Hugging Face: --like PRETRAINED (the save_pretrained folder that --init-from read) writes
OUT as such a folder instead: safetensors under PRETRAINED's names (a wrapper's prefix off, a tied
head left out as Hugging Face leaves it), in shards with an index above --max-shard-size, and
PRETRAINED's other files (config.json): from_pretrained(OUT) is the trained model. The weights may
also come from --save's file (CHECKPOINT_DIR a file).
"""

import argparse
import json
import os
import shutil
import sys
import warnings

if __package__ in (None, ""):  # python plumbing/consolidate.py: the project's folder, to import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plumbing.failures import UsageError
from plumbing.outputs import write_atomically

PREFIX = "model."  # Checkpoints.save's {"model": ..., "optimizer": ..., "rng": ...}


def consolidate(directory, out):
    """Write the model of ``directory`` (see checkpoint_dir.newest) to ``out``; return a line that
    says what."""
    path, info, tensors = consolidated(directory)
    # As --save, not by save_on_rank_0: its finite check holds temporaries up to 3 x the largest
    # tensor, and Checkpoints.save saved finite ones.
    size = sum(t.nbytes for t in tensors.values())
    write_atomically(out, lambda file: torch.save(tensors, file), size)
    return (
        f"wrote {out}: the model of {path} (step {info['step']}, saved by "
        f"{info['layout']['world_size']} rank(s)), {len(tensors)} tensors, {size / 1e6:.1f} MB"
    )


def consolidated(directory):
    """(the checkpoint, its checkpoint.json, its model's tensors by name) of ``directory`` (see
    checkpoint_dir.newest), once its checksums are checked."""
    from plumbing.checkpoint_dir import newest, verify

    path = newest(directory)
    info, problem = verify(path)  # each file's size and checksum
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
    with warnings.catch_warnings():  # one process, no group: as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": tensors}, checkpoint_id=path, no_dist=True)  # one process: no collective
    return path, info, tensors


def to_hugging_face(source, out, like, max_shard_bytes):
    """Write the model of ``source`` (a checkpoint, or --save's file) to the folder ``out`` as the
    save_pretrained folder ``like`` holds its weights; return a line that says what."""
    from safetensors.torch import save_file  # optional

    from plumbing.init_from import check

    if os.path.isfile(source):
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    else:
        state = consolidated(source)[2]
    ties = {}  # each name: the first name whose tensor it equals (a tied weight, saved twice)
    for name, tensor in state.items():
        same = (n for n, t in state.items() if t.shape == tensor.shape and torch.equal(t, tensor))
        ties[name] = next(same)
    shapes = {name: list(tensor.shape) for name, tensor in state.items()}
    names = check(like, shapes, ties)[2]  # ours: (file, theirs); a tied head left out
    weights = {key: state[name].contiguous() for name, (_, key) in names.items()}
    shards, size = [{}], 0
    for key, tensor in weights.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards, size = [*shards, {}], 0
        shards[-1][key], size = tensor, size + tensor.nbytes
    temporary = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    folder = like if os.path.isdir(like) else os.path.dirname(like)
    shutil.copytree(folder, temporary, ignore=lambda _, files: [f for f in files if weighty(f)])
    weight_map = {}
    for index, shard in enumerate(shards):
        file = "model.safetensors"
        if len(shards) > 1:
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(temporary, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    if len(shards) > 1:
        total = sum(t.nbytes for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(temporary, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(temporary, out)
    return f"wrote {out}: {len(weights)} tensors as {like} names them, in {len(shards)} file(s)"


def weighty(file):
    """A file of weights, which the trained ones replace."""
    return file.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python plumbing/consolidate.py", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a step-<N> directory, or a --checkpoint-dir (its newest step-<N>)",
    )
    parser.add_argument("out", metavar="OUT.pt", help="the file to write (replaced atomically)")
    parser.add_argument(
        "--like",
        metavar="PRETRAINED",
        help="write OUT as a Hugging Face folder, under the names of this save_pretrained folder",
    )
    parser.add_argument(
        "--max-shard-size", type=float, default=5000, help="MB per file with --like (default 5000)"
    )
    args = parser.parse_args(argv)
    try:
        if args.like:
            size = int(args.max_shard_size * 1e6)
            print(to_hugging_face(args.checkpoint, args.out, args.like, size))
        else:
            print(consolidate(args.checkpoint, args.out))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
