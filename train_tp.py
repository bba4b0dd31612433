"""Train a model with tensor parallelism (TP) inside groups of --tp ranks, and FSDP2 across them.

Launch (the README and run_tp.sh use the same commands):
    python train_tp.py --tp 1                                      # one process: nothing split
    torchrun --standalone --nproc-per-node=2 train_tp.py           # one node, 2 processes: tp 2
    torchrun --standalone --nproc-per-node=4 train_tp.py --tp 2    # 4 processes: tp 2 x dp 2
    torchrun --standalone --nproc-per-node=2 train_tp.py --model gpt  # the GPT: tp_plan()
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_tp.py  # on each node
Through the wrapper: `bash run_tp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_tp.sh [flags]`.

What TP changes compared with train_fsdp.py:
  setup  a 2-D mesh (dp, tp): --tp ranks split each layer; their groups are data parallel
  data   one share per tp group: its ranks see the same batch
  wrap   the GPT (--model gpt): parallelize_module() with tp_plan(), the plan to copy
         for a transformer (heads, MLP, sequence parallelism, vocabulary-split logits);
         BabyCNN: tensor_parallel() splits pairs of layers by channels, written out to
         show what TP does inside. Then fully_shard() over dp, with FSDP's units
         (plumbing/parts.py); the optimizer after both
  loss   loss_parallel(): cross-entropy over the GPT's vocabulary-split logits
  eval   each tp group scores a slice; the sums are all-reduced over dp
Every collective is called here, or in a call marked "collective".
"""

import logging
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data.distributed import DistributedSampler

import models
from models import data
from plumbing import failures, outputs, parts, training, watch
from plumbing.training import START
from plumbing.watch import log

# A query, key and value in one Linear: GPT-2's c_attn, qkv_proj, query_key_value, in_proj
FUSED = re.compile(r"qkv|c_attn|query_key_value|in_proj", re.IGNORECASE)


def main():
    parser = training.parser(__doc__.splitlines()[0], data.add_arguments)
    add_arguments(parser)
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the device
    device = training.pick_device(args, local_rank)
    # Before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download, model=args.model)
    backend = dist.get_default_backend_for_device(device)  # NCCL or gloo
    dist.init_process_group(backend, **failures.process_group_options(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = training.dtype_of(args)  # bf16: MixedPrecisionPolicy
    check_flags(args, world_size)
    mesh = make_mesh(args, device, world_size)  # (dp, tp)
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    # ---- data: the sampler deals each rank its share ----
    # collective: all ranks train on the same data
    dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)
    # A share per tp group: its ranks see the same batch; drop_last: none repeated
    sampler = DistributedSampler(train_set, dp, dp_rank, seed=args.seed, drop_last=True)
    plan = training.Plan(args, len(sampler), dp, dataset_name, "tp groups")
    outputs.check(args)  # collective: fails now, not after training
    if checkpointing := args.checkpoint_dir or args.resume_from:  # opt-in: imported only then
        from plumbing import checkpoint_dir
    checkpoints = checkpoint_dir.Checkpoints(args, plan, device) if checkpointing else None
    seed = hash((args.seed, dp_rank))  # for this group's DataLoader workers
    train_batches = training.Batches(train_set, args.batch_size, device, dtype, args.workers, seed)
    test_batches = training.Batches(test_set, 512, device, dtype, args.workers)

    # ---- model: its parameters on meta (no memory) until each rank fills its own part ----
    torch.manual_seed(args.seed)
    with parts.parameters_on_meta():
        model = models.build(args, train_set, device, dtype)  # --model, for the data
    if not (fill := parts.filled_by(model, args)):  # nothing fills a part: whole, as train_ddp.py
        model = models.build(args, train_set, device, dtype)  # --model, for the data
    param_count = sum(p.numel() for p in model.parameters())
    training.check_data_fits(model, train_batches, test_batches)  # bad data: one line, now
    flops = watch.flops_per_sample(model, parts.on(model, next(test_batches([0]))[0]))

    # ---- wrap: split each layer across the tp ranks, then shard them over dp ----
    parallelize(model, args, mesh)
    parts.materialize(model, device, args, fill, log)  # collective: each rank fills its part
    optimizer = training.make_optimizer(args, model.parameters())  # after the split: its parts
    torch.manual_seed(args.seed + rank)  # dropout: no two ranks mask the same positions and samples

    # ---- resume: from the newest checkpoint, if any ----
    resumed = checkpoints.resume(model, optimizer, log) if checkpoints else START  # collective
    what = f"TP {args.tp} x FSDP {dp} (mesh (dp, tp) {tuple(mesh.shape)}) on {world_size} rank(s)"
    figures = watch.describe(args, plan, param_count, flops, "tp group")
    log(f"{what} ({backend}, {device.type}): {figures}; {parts.BUILT[fill]}")

    # ---- train loop ----
    progress = watch.Progress(plan, args, device, resumed["step"])  # --log-dir, --profile-steps
    window = []  # micro-step losses since the last log, on the device
    stop = failures.StopSignals(resumed["step"])  # records signals as they come
    norm = None  # the gradients' norm (--max-grad-norm)
    skip = resumed["samples_into_epoch"] // plan.global_batch_size  # done this epoch
    for epoch in range(resumed["epoch"], plan.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        model.train()
        progress.start_epoch(epoch)
        first, skip = skip, 0
        last = min(plan.steps_per_epoch, first + plan.total_steps - progress.step)
        batches = train_batches(list(sampler)[first * plan.samples_per_step :])
        for step_in_epoch in range(first, last):
            optimizer.zero_grad(set_to_none=True)
            for micro_step in range(args.grad_accum):
                images, labels = next(batches)
                # Unsharded local gradients; the last micro-step reduce-scatters the sum
                last_micro_step = micro_step == args.grad_accum - 1
                model.set_requires_gradient_sync(last_micro_step)
                # logits (..., C), targets (...); the GPT's stay split by vocabulary
                with loss_parallel():  # collective: the GPT's loss all-reduces over tp
                    loss = F.cross_entropy(model(images).flatten(0, -2), labels.flatten())
                    (loss / args.grad_accum).backward()  # the mean over micro-steps
                window.append(local(loss.detach()))  # the same on every tp rank
            if args.max_grad_norm:  # collective: the shards' global norm
                norm = clip_grad_norm(model, args.max_grad_norm)
            lr = plan.lr(progress.step)
            training.set_lr(optimizer, lr)
            optimizer.step()
            progress.count_step()
            log_now = progress.is_logging_step(end_of_epoch=step_in_epoch == last - 1)
            # collective, about once a second: the ranks agree on a stop
            stop_signal = stop.agree_now(progress.step, log_now, device)
            if log_now or stop_signal:  # one all-reduce per window: the tp groups' mean
                window_loss = torch.stack(window).sum()
                dist.all_reduce(window_loss)
                mean_loss = window_loss.item() / (len(window) * world_size)
                outputs.refuse_divergence(progress.step, mean_loss, checkpoints)
                progress.record_loss(mean_loss, "loss (all ranks)", lr, norm)
                window.clear()
            progress.after_step()  # --profile-steps
            if checkpoints and checkpoints.is_due(progress.step, now=stop_signal):
                for buffer in model.buffers():  # rank 0's statistics are saved
                    dist.broadcast(buffer, src=0)
                # collective; refuses what is not finite
                checkpoints.save(progress.step, epoch, step_in_epoch + 1, model, optimizer, window)
            if stop_signal and progress.step < plan.total_steps:  # the last step just ends
                raise stop.stopped(progress.step, plan.total_steps, args.checkpoint_dir)

        # ---- evaluate: each tp group scores a slice; the sums are all-reduced ----
        if not args.no_eval:
            test_loss, test_accuracy = evaluate(model, test_batches, mesh)
            progress.record_test(test_loss, test_accuracy)
    progress.close()

    # ---- save: rank 0 gathers every rank's shards and writes ----
    if args.save:
        full_state = gather_full_state_dict(model)  # collective
        outputs.save_on_rank_0(full_state, args.save)  # collective
        log(f"saved the weights to {args.save}")
    if hasattr(train_set, "vocabulary"):  # text: rank 0 prints a sample
        log(models.sample(model, gather_full_state_dict(model), train_set.vocabulary))  # collective
    if args.metrics:  # collective: rank 0 gathers each rank's memory
        from plumbing import metrics

        run = {"strategy": "tp", "tp": args.tp, "mesh": list(mesh.shape)}
        metrics.write(args, plan, progress, model, optimizer, flops, param_count, **run)
    # Let go of the mesh, which torch 2.14's DTensor caches keep (private; not in 2.9):
    # else gloo's threads live into shutdown, where they may abort.
    getattr(mesh, "_pg_registry", {}).clear()


def add_arguments(parser):  # TP's flag
    parser.add_argument(
        "--tp",
        type=training.number(int, 1),
        default=2,
        help="ranks that split each layer; world size = dp groups x --tp",
    )


def gather_full_state_dict(model):
    """Collective: rank 0 gets the whole state dict, in CPU memory."""
    # torch 2.14 warns on each rank that a (dp, tp)-split tensor takes two all-gathers,
    # not one: the same tensor, a little slower.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def make_mesh(args, device, world_size):
    """world_size / tp data-parallel groups (rows) of tp ranks (columns).

    TP inside, as in torchtitan: a tp group's ranks are neighbours, on one node.
    """
    shape = (world_size // args.tp, args.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
    if device.type == "cuda":  # DTensor's dropout: its tracker made now, not with rank 0's seed
        torch.distributed.tensor._random.manual_seed(args.seed, mesh)  # as torchtitan's
    return mesh


def check_flags(args, world_size):
    """Refuse TP's flags that do not go together, before anything is built."""
    if not is_babycnn(args) and world_size % args.tp:  # tp_plan() checks the heads
        raise failures.UsageError(f"--tp {args.tp} must divide the world size {world_size}")
    if is_babycnn(args) and (world_size % args.tp or args.width * 8 % args.tp):
        raise failures.UsageError(
            f"--tp {args.tp} must divide the world size {world_size} and BabyCNN's "
            f"{args.width * 8} channels (8 x --width), which it splits"
        )
    if args.compile:
        raise failures.UsageError(
            "--compile is for train_ddp.py and train_fsdp.py: train_tp.py's split layers "
            "call collectives of their own"
        )
    # A tp group over two nodes: its collectives, several a layer, would cross the network.
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # this node's ranks (torchrun's)
    if node % args.tp:
        log(f"warning: --tp {args.tp} spans nodes of {node} ranks: give one that divides {node}")


def is_babycnn(args):  # --model cnn; a copy has no --model, and its model takes a plan
    return getattr(args, "model", None) == "cnn"


def parallelize(model, args, mesh):
    """TP inside each row of the (dp, tp) mesh, then FSDP2 down its columns.

    Each rank keeps a 1/dp shard of its 1/tp part of each weight.
    """
    mp_policy = root_policy = MixedPrecisionPolicy()
    if args.precision == "bf16":  # reduce in fp32; bf16 between units, for the root's own modules
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)  # logits
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if is_babycnn(args):  # BabyCNN's split, written out: what a plan's styles do inside
        tensor_parallel(model, mesh["tp"])
    else:  # a transformer: a plan keyed by module names, the form to copy
        tied = parts.tied_names(model)  # before the split gives each module a new parameter
        parallelize_module(model, mesh["tp"], checked(tp_plan, model, args.tp))
        retie(model, tied)
    for name in frozen:  # torch 2.9's styles make each new parameter trainable (pytorch #171523)
        model.get_parameter(name).requires_grad_(False)
    units, _ = parts.shard_units(model)  # FSDP's: each layer; tied weights in the root
    for index, (parent, name) in enumerate(units):
        # Backward starts with the last unit: resharding it would only regather.
        last = index == len(units) - 1
        options = {"reshard_after_forward": not last, "mp_policy": mp_policy}
        fully_shard(getattr(parent, name), mesh=mesh["dp"], **options)
    fully_shard(model, mesh=mesh["dp"], mp_policy=root_policy)


def tp_plan(model, tp):
    """The GPT's tensor-parallel plan: a ParallelStyle for each module name (models/gpt.py's).
    For your model, write its own: docs/transformer.md has a Hugging Face Llama's.

    In each block, qkv splits column-wise (its rows ordered by head: a rank computes
    whole heads), the output projection row-wise: one reduce-scatter of its partial
    sums; the MLP likewise. Between blocks the residual stream stays split by positions,
    Shard(1) (sequence parallelism): norms and dropouts work on 1/tp of them, and
    each norm's output is all-gathered once for the attention or the MLP. The head
    splits the vocabulary and keeps its logits split, for loss_parallel().
    """
    attention = model.blocks[1].attn  # the heads, read from the model
    heads = attention.qkv.out_features // (3 * attention.head_dim)
    if heads % tp:
        raise failures.UsageError(f"--tp {tp} must divide the GPT's {heads} heads")
    positions = Shard(1)  # of (batch, positions, n_embd): the residual stream
    whole = Replicate()
    plan = {  # the embedding: a rank holds 1/tp of the rows; the sums reduce-scattered
        "blocks.0.tokens": RowwiseParallel(
            input_layouts=whole, output_layouts=positions, use_local_output=False
        ),
        # The position table (positions, n_embd) split on dim 0 lines up with Shard(1)
        # of the tokens' (batch, positions, n_embd). A rank holds its own positions' rows,
        # so the reduce-scatter adds zeros: 1/batch of the tokens' bytes.
        "blocks.0.positions": RowwiseParallel(
            input_layouts=whole, output_layouts=Shard(0), use_local_output=False
        ),
        "blocks.0.dropout": SequenceParallel(),
    }
    # PrepareModuleInput gathers the positions once for the attention and the MLP;
    # use_local_output=False keeps the stream a DTensor: x + attn(x) adds like placements.
    block = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=positions, desired_input_layouts=whole),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=positions, use_local_output=False),
        "attn.resid_dropout": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=positions, desired_input_layouts=whole),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=positions, use_local_output=False),
        "mlp.dropout": SequenceParallel(),
    }
    for index in range(1, len(model.blocks) - 1):  # blocks.0 is Embed, the last Head
        plan |= {f"blocks.{index}.{name}": style for name, style in block.items()}
    head = f"blocks.{len(model.blocks) - 1}"
    plan[f"{head}.norm"] = SequenceParallel()
    # Logits (batch, positions, vocabulary) split by vocabulary, kept a DTensor.
    plan[f"{head}.out"] = ColwiseParallel(
        input_layouts=positions, output_layouts=Shard(-1), use_local_output=False
    )
    return plan


def checked(make_plan, model, tp):
    """``make_plan(model, tp)``, refused in one line where it does not fit the model: a
    name it lacks, a module ColwiseParallel and RowwiseParallel cannot split (they take
    nn.Linear and nn.Embedding), a query, key and value fused in one matrix."""
    try:
        plan = make_plan(model, tp)
    except AttributeError as error:  # a copy's model, and the GPT's plan
        raise failures.UsageError(
            f"{make_plan.__name__}() does not fit your model ({error}): write its plan, with "
            "your model's module names (docs/transformer.md)"
        ) from None
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if name not in modules:
            raise failures.UsageError(
                f"the TP plan names {name}, which your model does not have: name its "
                "modules as model.named_modules() does"
            )
        module = modules[name]
        splits = isinstance(style, (ColwiseParallel, RowwiseParallel))
        if splits and not isinstance(module, (nn.Linear, nn.Embedding)):
            raise failures.UsageError(
                f"the TP plan splits {name}, a {type(module).__name__}, but ColwiseParallel and "
                "RowwiseParallel split nn.Linear and nn.Embedding only: make it an nn.Linear "
                "(a Hugging Face Conv1D holds the transpose of a Linear's weight)"
            )
        by_head = getattr(module, "rows_by_head", False)  # the GPT's qkv: whole heads a rank
        if splits and FUSED.search(name.rpartition(".")[2]) and not by_head:
            raise failures.UsageError(
                f"the TP plan splits {name}, which computes query, key and value in one "
                "matrix: a split by rows gives a rank all the queries and none of the values; "
                "make three nn.Linears of it, or order its rows by head and set its "
                "rows_by_head = True (docs/transformer.md)"
            )
    return plan


def retie(model, tied):
    """One parameter again for each tied weight, where parallelize_module gave each module a
    new one: refused if the plan splits the copies unlike."""
    for first, *others in tied:
        weight = model.get_parameter(first)
        for name in others:
            copy = model.get_parameter(name)
            layouts = [str(getattr(p, "placements", "not split")) for p in (weight, copy)]
            if copy is not weight and layouts[0] != layouts[1]:
                raise failures.UsageError(
                    f"{first} and {name} are one weight (tied), but the TP plan splits them "
                    f"unlike ({layouts[0]} and {layouts[1]}): split both by vocabulary (the "
                    "embedding RowwiseParallel, the head ColwiseParallel) or neither"
                )
            module, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(module), attribute, weight)


def local(tensor):
    """A DTensor's local tensor (the GPT's loss, the same on each tp rank), else tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_parallel(model, tp_mesh):
    """Split BabyCNN's layers across the ranks of tp_mesh, in pairs.

    The first of a pair keeps 1/tp of its output channels (column-wise); the second
    takes those channels in (row-wise) and adds up its partial outputs: one all-reduce
    in forward, one for the pair's input gradient in backward. Each weight becomes a
    DTensor on tp_mesh: a checkpoint knows which part each rank holds.
    """
    group = tp_mesh.get_group()
    for block in model.blocks[:-1]:  # ConvBlock: conv1 -> ReLU -> conv2
        split_conv(block.conv1, tp_mesh, Shard(0), group)  # output channels
        split_conv(block.conv2, tp_mesh, Shard(1), group)  # input channels
    split_conv(model.blocks[-1].conv, tp_mesh, Shard(0), group)  # Head: conv, ..., fc
    # torch's TP API covers Linear: fc takes the channels as they are split.
    fc = parallelize_module(model.blocks[-1].fc, tp_mesh, RowwiseParallel())
    # RowwiseParallel returns a view of a DTensor's local tensor: FSDP warns of it.
    fc.register_forward_hook(lambda module, inputs, output: output.clone())


def split_conv(conv, tp_mesh, weight_placement, group):
    """Keep this rank's part of conv's weight and bias, and a forward that uses only it.

    By output channels, Shard(0), or input channels, Shard(1).
    """
    column = weight_placement == Shard(0)
    bias_placement = Shard(0) if column else Replicate()  # row-wise: added to the sum
    weight = distribute_tensor(conv.weight.detach(), tp_mesh, [weight_placement])
    conv.weight = nn.Parameter(weight)
    conv.bias = nn.Parameter(distribute_tensor(conv.bias.detach(), tp_mesh, [bias_placement]))

    def forward(x):
        weight, bias = conv.weight.to_local(), conv.bias.to_local()
        if column:  # x is whole on every rank; backward sums its gradient's parts
            return F.conv2d(AllReduceBackward.apply(x, group), weight, bias, padding=conv.padding)
        partial = F.conv2d(x, weight, None, padding=conv.padding)  # its channels' share
        return AllReduceForward.apply(partial, group) + bias.view(1, -1, 1, 1)

    conv.forward = forward


class AllReduceForward(torch.autograd.Function):
    """Sum the tp ranks' partial outputs (Megatron's g); each part's gradient is the same."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceBackward(torch.autograd.Function):
    """The identity on a tensor every tp rank holds whole (Megatron's f).

    Each rank used it for its own channels: its gradient is the sum of their parts.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # all_reduce works in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def clip_grad_norm(model, max_norm):
    """Collective: clip the sharded gradients to their global norm; returns it, before clipping.

    A layer the plan leaves whole is sharded over dp alone: its gradients' norm is
    summed over that mesh, the split layers' over (dp, tp).
    """
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    squares = []
    for params in by_mesh.values():  # of the shards: "Partial"
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append(norm.full_tensor() ** 2)  # collective: all-reduced
    norm = torch.stack(squares).sum().sqrt()
    for params in by_mesh.values():  # torch's foreach ops take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def evaluate(model, test_batches, mesh):
    """Collective: the test loss and accuracy over every tp group's slice."""
    for buffer in model.buffers():  # BatchNorm's: rank 0's, as saved
        dist.broadcast(buffer, src=0)
    model.eval()
    # Loss sum, correct, count on this group; each forward all-reduces over tp.
    dp_rank, dp = mesh.get_local_rank("dp"), mesh["dp"].size()

    def forward(inputs):  # the GPT's logits all-gathered whole
        logits = model(inputs)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    totals = training.evaluate(forward, test_batches, dp_rank, dp)
    dist.all_reduce(totals, group=mesh.get_group("dp"))
    for module in model.modules():  # no backward frees what these gathered
        if isinstance(module, FSDPModule):  # (the last block)
            module.reshard()
    return (totals[:2] / totals[2]).tolist()


if __name__ == "__main__":
    failures.run(main, data.DataError)  # one-line errors, exit codes
