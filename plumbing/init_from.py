"""--init-from PATH: start from pretrained weights with a fresh optimizer (opt-in: imported only
when the flag is given, so a copy without this file refuses the flag in one line).

PATH is what users have: a Hugging Face save_pretrained folder (model.safetensors, or shards and
model.safetensors.index.json), a .safetensors file or index, --save's file, or a --checkpoint-dir
(or one step-<N> of it). Names are matched as they are, or with a prefix on either side when only
one prefix fits (a wrapper's ``lm.``); a tied weight the file holds once (Hugging Face leaves the
tied head out) is filled through the name it has. Each rank reads only the bytes of what it holds:
a DTensor's own rows and columns (FSDP's shard, TP's part), a pipeline stage's own blocks.
"""

import json
import os

import torch
import torch.distributed as dist

from plumbing.failures import UsageError, on_rank_0

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def load(model, path, log):
    """Collective: ``path``'s weights into ``model`` (whole, a stage, or sharded: DTensors); rank 0
    checks the names and shapes, then every rank reads its own parts."""
    mine = model.state_dict(keep_vars=True)  # keep_vars: a tied weight is one object
    shapes = {name: list(tensor.shape) for name, tensor in mine.items()}  # a DTensor's: global
    ties = {}  # each name: the first name of its weight
    for name, tensor in mine.items():
        ties[name] = next(n for n, t in mine.items() if t is tensor)
    plan = on_rank_0(lambda: check(path, shapes, ties), f"reading --init-from {path}")
    kind, files, names = plan  # names: {this model's name: (file, the file's name)}
    with torch.no_grad():
        if kind == "dcp":  # DCP reads each rank's parts itself
            import torch.distributed.checkpoint as dcp

            dcp.load(
                {"model": {key: mine[n] for n, (_, key) in names.items()}}, checkpoint_id=files[0]
            )
        done = set()  # a tied weight, once
        for file in files if kind != "dcp" else []:
            with open_weights(file) as weights:
                for name, (where, key) in names.items():
                    if where == file and id(mine[name]) not in done:
                        done.add(id(mine[name]))
                        fill(mine[name], lambda index, key=key: weights(key, index))
    how = "each rank read its own parts" if dist.get_world_size() > 1 else "read"
    log(
        f"initialised the model from {path} ({len(names)} tensors, {how}); the optimizer and "
        "the lr schedule start afresh"
    )


def fill(tensor, read):
    """Copy into ``tensor`` what ``read(index)`` gives for its part: a DTensor's local chunk
    (its offsets in the whole), or all of a plain tensor."""
    local = tensor
    index = ()
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's chunk, by its global offsets
        (chunk,) = tensor.__create_chunk_list__()
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        local = tensor.to_local()
    if local.numel():
        local.copy_(read(index))


class open_weights:
    """A file's tensors by name, each read as a slice: ``weights(key, index)``."""

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        if self.file.endswith(".safetensors"):
            from safetensors import safe_open  # optional

            self.handle = safe_open(self.file, "pt").__enter__()  # mapped: slices read alone
            handle = self.handle
            return lambda key, index: (
                handle.get_slice(key)[index] if index else handle.get_tensor(key)
            )
        state = torch.load(self.file, map_location="cpu", weights_only=True, mmap=True)
        return lambda key, index: state[key][index]

    def __exit__(self, *exc):
        if hasattr(self, "handle"):
            self.handle.__exit__(*exc)


def check(path, shapes, ties):
    """On rank 0: what ``path`` is, its files, and each name of ours matched to one there; a misfit
    is one line naming the tensor."""
    kind, files, found = listing(path)  # found: {the file's name: (file, shape)}
    misfit = f"--init-from {path} does not fit this model"
    ours = [n for n in shapes if ties[n] == n]  # one name per weight; its ties share it
    best, fits = None, []
    for mapping in prefixes(list(shapes), list(found)):
        names = {n: mapping(n) for n in shapes if mapping(n) in found}
        held = {ties[n] for n in names}
        if all(n in held for n in ours) and set(names.values()) == set(found):
            fits += [names] if names not in fits else []
        if best is None or len(names) > len(best):
            best = names
    if len(fits) > 1:
        a, b = (next(iter(f.items())) for f in fits[:2])
        raise UsageError(f"--init-from {path}: its names fit ours two ways ({a} and {b})")
    if not fits:
        held = {ties[n] for n in best}
        if missing := [n for n in ours if n not in held]:
            raise UsageError(f"{misfit}: it has no {missing[0]}")
        extra = sorted(set(found) - set(best.values()))
        raise UsageError(f"{misfit}: it has {extra[0]}, which this model lacks")
    names = fits[0]
    for name, key in names.items():
        if found[key][1] != shapes[name]:
            there, here = found[key][1], shapes[name]
            raise UsageError(f"{misfit}: {name} is {there} there, {here} here")
    return kind, files, {n: (found[k][0], k) for n, k in names.items()}


def prefixes(ours, theirs):
    """The ways to read our names in theirs: as they are, or less a prefix all of one side's
    names share (``lm.`` of a wrapper), or with one."""

    def common(names):  # the dotted prefixes that every name starts with
        first = names[0].split(".")[:-1] if names else []
        out = [".".join(first[:i]) + "." for i in range(1, len(first) + 1)]
        return [p for p in out if all(n.startswith(p) for n in names)]

    yield lambda name: name
    for prefix in common(ours):
        yield lambda name, p=prefix: name[len(p) :]
    for prefix in common(theirs):
        yield lambda name, p=prefix: p + name


def listing(path):
    """(kind, files, {name: (file, shape)}) of what ``path`` holds: safetensors, a torch.save
    file or a DCP checkpoint."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            return listing(os.path.join(path, INDEX))
        if os.path.exists(os.path.join(path, SINGLE)):
            return listing(os.path.join(path, SINGLE))
        from plumbing.consolidate import newest  # a checkpoint, or its newest step

        try:
            checkpoint = newest(path)
        except UsageError:
            raise UsageError(
                f"--init-from {path}: a folder with no {SINGLE}, {INDEX} or checkpoint"
            ) from None
        return "dcp", [checkpoint], checkpoint_listing(checkpoint)
    if not os.path.isfile(path):
        raise UsageError(f"--init-from {path}: no such file or folder")
    try:
        if path.endswith(".index.json"):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            folder = os.path.dirname(path)
            files = sorted({os.path.join(folder, f) for f in weight_map.values()})
            found = {}
            for file in files:
                found |= safetensors_listing(file)
            if missing := set(weight_map) - set(found):
                raise ValueError(f"the index names {sorted(missing)[0]}, which no shard holds")
            return "safetensors", files, found
        if path.endswith(".safetensors"):
            return "safetensors", [path], safetensors_listing(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except ImportError:
        why = "reading .safetensors needs pip install safetensors"
        raise UsageError(f"--init-from {path}: {why}") from None
    except Exception as error:  # the errors vary
        why = " ".join(str(error).split())[:200]
        raise UsageError(f"--init-from {path} is not a file of weights ({why})") from None
    if not isinstance(state, dict) or not all(map(torch.is_tensor, state.values())):
        raise UsageError(f"--init-from {path} holds no state dict of tensors")
    return "torch", [path], {name: (path, list(t.shape)) for name, t in state.items()}


def safetensors_listing(file):
    from safetensors import safe_open  # optional

    with safe_open(file, "pt") as handle:  # the header only
        return {key: (file, list(handle.get_slice(key).get_shape())) for key in handle.keys()}


def checkpoint_listing(checkpoint):
    """A checkpoint's model tensors (names less ``model.``), once its SHA-256s are checked."""
    import torch.distributed.checkpoint as dcp

    from plumbing.checkpoint_dir import verify

    if problem := verify(checkpoint)[1]:
        raise UsageError(f"--init-from {checkpoint} is damaged ({problem})")
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    shapes = {k[len("model.") :]: list(v.size) for k, v in saved.items() if k.startswith("model.")}
    return {name: (checkpoint, shape) for name, shape in shapes.items()}
