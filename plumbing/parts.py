"""A model in parts, for the scripts that split it (train_fsdp.py, train_tp.py, train_pippy.py):
built on the meta device (shapes, no memory), then each rank allocates and fills only its own part,
from the seed or from --init-from; the units FSDP shards; the weights that modules share (tied)."""

import contextlib
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

BUILT = {  # the start line's words on how the model was built
    None: "built whole: your model has no reset_parameters() to fill a part (docs/fsdp.md)",
    "seed": "built on meta, each rank's part filled from the seed",
    "init_from": "built on meta, each rank's part read from --init-from",
}


@contextlib.contextmanager
def parameters_on_meta():
    """Each parameter a module registers inside goes to the meta device: a shape, no memory (one
    parameter is real at a time, as it is made); buffers stay real (BatchNorm's statistics, a
    rotary table), as torch.device("meta") would not keep them; .to() keeps meta on meta."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with Parts():
            yield
    finally:
        nn.Module.register_parameter = register


class Parts(TorchFunctionMode):
    """While a model is built on meta and filled: ``tensor.to(device, dtype)`` of a meta tensor
    changes only its dtype (``Module.to``), and a whole tensor copied into a DTensor fills this
    rank's part of it (an init that draws each parameter whole)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args[0].is_meta:
            given = [*args[1:], kwargs.get("dtype")]
            dtype = next((a for a in given if isinstance(a, torch.dtype)), args[0].dtype)
            return func(args[0], dtype=dtype)
        if func is torch.Tensor.copy_ and isinstance(args[0], DTensor):
            if not isinstance(args[1], DTensor):
                (chunk,) = args[0].__create_chunk_list__()  # its offsets in the whole
                index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                args[0].to_local().copy_(args[1][index])
                return args[0]
        return func(*args, **kwargs)


def filled_by(model, args):
    """How a model built on meta gets its values; None if nothing fills a part: build it whole,
    from the seed, set again here."""
    if args.init_from:
        return "init_from"
    if hasattr(model, "reset_parameters"):
        return "seed"
    torch.manual_seed(args.seed)
    return None


def on(model, inputs):
    """``inputs`` on the device of the model's parameters: meta, until they are filled."""
    return inputs.to("meta") if next(model.parameters()).is_meta else inputs


def materialize(model, device, args, fill, log, holds=None):
    """Collective: allocate this rank's part of every parameter (``to_empty``), of the modules it
    ``holds`` (a pipeline stage's blocks; default: all), and fill it, from the file or as the
    model's reset_parameters() fills the whole, from the seed; the buffers, real all along, kept;
    the rest stays on meta. Nothing to fill for a model built whole (``fill`` None). Logs each
    rank's parameters (the bytes it allocated) and its peak memory."""
    if fill:
        buffers = [
            (m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None
        ]
        tied = tied_names(model)  # to_empty gives each module its own copy
        for module in holds or [model]:
            module.to_empty(device=device)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer.to(device)
        for names in tied:  # one parameter again, a real one if this rank holds any
            weight = min((model.get_parameter(n) for n in names), key=lambda p: p.is_meta)
            for name in [n for n in names if model.get_parameter(n) is not weight]:
                module, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(module), attribute, weight)
    if fill == "init_from":  # what stays on meta is not read
        from plumbing import init_from

        init_from.load(model, args.init_from, log)  # collective
    elif fill:  # bitwise the values of a whole build: each parameter drawn whole, its part kept
        torch.manual_seed(args.seed)
        with torch.no_grad(), Parts():
            model.reset_parameters()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    held = sum(p.nbytes for p in local if not p.is_meta)  # what this rank allocated
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; RSS
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (held, peak))  # collective
    held = ", ".join(f"{h / 1e6:,.3f}" for h, _ in ranks)
    peaks = ", ".join(f"{p / 1e6:,.0f}" for _, p in ranks)
    log(f"each rank's parameters once filled: {held} MB; each rank's peak memory: {peaks} MB")


def tied_names(model):
    """The names of each weight that several modules share (an LM's embedding and head), one
    list a weight, in the model's order: the one rule the scripts find tied weights by."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return [group for group in names.values() if len(group) > 1]


def shard_units(model):
    """The submodules to shard, as (parent, name), inner ones first, and words on them:
    each layer of a list of layers (nn.Sequential, nn.ModuleList: BabyCNN's blocks, a
    BERT's bert.encoder.layer) not inside another, then each child of the model. A unit
    holds the parameters no unit before it holds (none: no unit); the root the rest.
    No unit holds a weight tied to a module outside it (an LM's embedding and head):
    fully_shard on each would make two weights of it, so a unit around both holds it."""

    def layers(module):  # those of the outermost lists of layers in module
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            return [(module, name) for name, _ in module.named_children()]
        return [unit for child in module.children() for unit in layers(child)]

    holders = [{model.get_submodule(n.rpartition(".")[0]) for n in ns} for ns in tied_names(model)]

    def tied_outside(unit):
        inside = set(unit.modules())
        return any(modules & inside and modules - inside for modules in holders)

    units = [u for name, child in model.named_children() for u in [*layers(child), (model, name)]]
    units = [(parent, name) for parent, name in units if not tied_outside(getattr(parent, name))]
    held = [set(getattr(p, n).parameters()) for p, n in units] + [set(model.parameters())]
    sizes = [sum(p.numel() for p in mine.difference(*held[:i])) for i, mine in enumerate(held)]
    share, count = max(sizes) / sum(sizes), sum(map(bool, sizes))
    words = f"{count} units, the largest {share:.0%} of the parameters"
    return [unit for unit, size in zip(units, sizes) if size], words
