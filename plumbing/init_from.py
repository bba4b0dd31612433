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
import math
import os
import struct

import torch
import torch.distributed as dist

from plumbing.failures import UsageError, input_error, on_rank_0

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

            state = {key: mine[n] for n, (_, key) in names.items() if not mine[n].is_meta}
            dcp.load({"model": state}, checkpoint_id=files[0])
        done = set()  # a tied weight, once
        for file in files if kind != "dcp" else []:
            try:
                with open_weights(file) as weights:
                    for name, (where, key) in names.items():
                        if where == file and id(mine[name]) not in done:
                            done.add(id(mine[name]))
                            fill(mine[name], lambda index, key=key: weights(key, index))
            except OSError as error:  # an I/O error is one, not a file of something else
                error.filename = file if error.filename is None else error.filename  # a read's
                raise input_error(error, "--init-from") from None
    how = "each rank read its own parts" if dist.get_world_size() > 1 else "read"
    log(
        f"initialised the model from {path} ({len(names)} tensors, {how}); the optimizer and "
        "the lr schedule start afresh"
    )


def fill(tensor, read):
    """Copy into ``tensor`` what ``read(index)`` gives for its part: a DTensor's local chunk
    (its offsets in the whole), or all of a plain tensor (none of one on meta)."""
    local = tensor
    index = ()
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's chunk, by its global offsets
        (chunk,) = tensor.__create_chunk_list__()
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        local = tensor.to_local()
    if local.numel() and not local.is_meta:  # meta: another stage's, not read
        local.copy_(read(index))


class open_weights:
    """A file's tensors by name, each read as a slice: ``weights(key, index)``."""

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        if self.file.endswith(".safetensors"):
            self.safetensors = Safetensors(self.file)
            return self.safetensors.read
        state = torch.load(self.file, map_location="cpu", weights_only=True, mmap=True)
        return lambda key, index: state[key][index]

    def __exit__(self, *exc):
        if hasattr(self, "safetensors"):
            os.close(self.safetensors.fd)


class Safetensors:
    """A .safetensors file read by hand, with pread: only the bytes of the rows (and, in a
    matrix, the columns) asked for, into memory of this process's own; no mapping of the file
    (safetensors' maps it whole, and a private mapping counts as this process's memory)."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16}
    DTYPES |= {"BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool}
    DTYPES |= {"I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}

    def __init__(self, file):
        self.fd = os.open(file, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.header = json.loads(os.pread(self.fd, size, 8))
        self.header.pop("__metadata__", None)
        self.start = 8 + size

    def shapes(self):
        return {key: list(info["shape"]) for key, info in self.header.items()}

    def read(self, key, index=()):
        """Tensor ``key``'s part ``index`` (slices, one a dimension; () for all of it)."""
        info = self.header[key]
        dtype, shape = self.DTYPES[info["dtype"]], info["shape"]
        if not shape:  # a scalar
            return self._read(info["data_offsets"][0], 1, dtype).reshape(())
        index = (*index, *(slice(0, n) for n in shape[len(index) :]))
        row = math.prod(shape[1:]) * dtype.itemsize  # bytes
        first, rows = index[0].start, index[0].stop - index[0].start
        begin = info["data_offsets"][0] + first * row
        if len(shape) == 2 and index[1] != slice(0, shape[1]):  # a column split: each row's part
            columns = index[1].stop - index[1].start
            parts = [
                self._read(begin + r * row + index[1].start * dtype.itemsize, columns, dtype)
                for r in range(rows)
            ]
            return torch.stack(parts) if parts else torch.empty(0, columns, dtype=dtype)
        whole_rows = self._read(begin, rows * math.prod(shape[1:]), dtype)
        return whole_rows.reshape(rows, *shape[1:])[(slice(None), *index[1:])]

    def _read(self, offset, count, dtype):
        data = bytearray(count * dtype.itemsize)  # read into: no second copy
        view, done = memoryview(data), 0
        while done < len(data):  # a read gives at most 2 GB
            if not (got := os.preadv(self.fd, [view[done:]], self.start + offset + done)):
                raise ValueError("the file is shorter than its header says")
            done += got
        return torch.frombuffer(data, dtype=dtype) if count else torch.empty(0, dtype=dtype)


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
        from plumbing.checkpoint_dir import newest  # a checkpoint, or its newest step

        try:
            checkpoint = newest(path)
        except UsageError:
            raise UsageError(
                f"--init-from {path}: a folder with no {SINGLE}, {INDEX} or checkpoint"
            ) from None
        return "dcp", [checkpoint], checkpoint_listing(checkpoint)
    try:
        with open(path, "rb"):  # the OS's own word: missing, a permission, a device's error
            pass
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
    except OSError as error:  # an I/O error is one, not a file of something else
        error.filename = path if error.filename is None else error.filename  # a read's
        raise input_error(error, "--init-from") from None
    except Exception as error:  # the errors vary
        why = " ".join(str(error).split())[:200]
        raise UsageError(f"--init-from {path} is not a file of weights ({why})") from None
    if not isinstance(state, dict) or not all(map(torch.is_tensor, state.values())):
        raise UsageError(f"--init-from {path} holds no state dict of tensors")
    return "torch", [path], {name: (path, list(t.shape)) for name, t in state.items()}


def safetensors_listing(file):
    """{name: (file, shape)} of a .safetensors file, from its header alone."""
    reader = Safetensors(file)
    try:
        return {key: (file, shape) for key, shape in reader.shapes().items()}
    finally:
        os.close(reader.fd)


def checkpoint_listing(checkpoint):
    """A checkpoint's model tensors (names less ``model.``), once its checksums are checked."""
    import torch.distributed.checkpoint as dcp

    from plumbing.checkpoint_dir import verify

    if problem := verify(checkpoint)[1]:
        raise UsageError(f"--init-from {checkpoint} is damaged ({problem})")
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    shapes = {k[len("model.") :]: list(v.size) for k, v in saved.items() if k.startswith("model.")}
    return {name: (checkpoint, shape) for name, shape in shapes.items()}
