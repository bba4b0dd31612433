"""Train BabyCNN with tensor parallelism (TP) inside each group of --tp ranks, and FSDP2 across the groups.

Launch (the README and run_tp.sh use the same commands):
    python train_tp.py --tp 1                                      # one process, no torchrun: nothing split
    torchrun --standalone --nproc-per-node=2 train_tp.py           # one node, 2 processes: tp 2
    torchrun --standalone --nproc-per-node=4 train_tp.py --tp 2    # 4 processes: tp 2 x dp 2
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_tp.py  # two nodes: on each node
Through the wrapper: `bash run_tp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_tp.sh [flags]`.

What TP changes compared with train_fsdp.py:
  setup  a 2-D device mesh (dp, tp): --tp ranks split each layer; the groups of them are data parallel
  data   the sampler deals one share per tp group: its ranks see the same batch
  wrap   tensor_parallel() splits each pair of layers by channels (one all-reduce per pair), then
         fully_shard() over the mesh's dp dimension; the optimizer is built after both
  eval   each tp group scores a slice of the test set; the sums are all-reduced over dp
Every collective is called here, or in a call marked "collective" (every rank must make it).
"""

import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.utils.data.distributed import DistributedSampler

from models import BabyCNN, data
from plumbing import core, hardening


def main():
    parser = core.parser(__doc__.splitlines()[0], data.add_arguments)
    parser.add_argument("--tp", type=core.number(int, 1), default=2,
                        help="ranks that split each layer; world size = data-parallel groups x --tp")
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # rank on this node: picks the GPU
    if core.use_cuda(args.device, local_rank):  # --device; one line if this node has too few GPUs
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dtype, _ = core.precision(args, device)  # the weights' dtype; bf16 comes from MixedPrecisionPolicy below
    # Find (or download) the data before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download)
    timeout = timedelta(minutes=10)  # a collective that waits longer than this fails instead of hanging
    if "RANK" in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        store = hardening.store_for_this_attempt(timeout)  # torchrun's, this restart's own part (None: env://)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), timeout=timeout,
                                world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    else:  # plain `python train_tp.py --tp 1`: a group of one, so every collective below runs unchanged
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank decides who logs and writes files
    progress = None
    mesh = None  # for the finally below, if setup fails before the mesh exists
    try:
        log = core.log if rank == 0 else (lambda line: None)  # above rank 0's progress bar

        # The device mesh: world_size / tp data-parallel groups (rows) of tp ranks (columns). TP innermost, as in
        # torchtitan: a group's ranks are neighbours, so on one node, where the all-reduces of every layer run.
        if world_size % args.tp or args.width * 8 % args.tp:
            raise core.UsageError(f"--tp {args.tp} must divide the world size {world_size} and BabyCNN's "
                                  f"{args.width * 8} channels (8 x --width), which it splits")
        if args.compile:
            raise core.UsageError("--compile is for train_ddp.py and train_fsdp.py: train_tp.py's split layers "
                                  "call collectives of their own")
        dp = world_size // args.tp
        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")

        # ---- data: map-style Datasets (bundled: on the device); DistributedSampler deals this group's share ----
        dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)  # collective
        # drop_last: without it, the sampler pads the shards to equal length by repeating samples, so some
        # would count twice in an epoch and no longer match one process on the whole set
        sampler = DistributedSampler(  # the ranks of one tp group must see the same batch: one share per group
            train_set, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True
        )
        samples_per_step = args.batch_size * args.grad_accum  # per tp group, per optimizer step
        steps_per_epoch = len(sampler) // samples_per_step
        if steps_per_epoch == 0:
            raise core.UsageError(
                f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than the "
                f"{len(sampler)} samples each of the {dp} tp groups gets from {dataset_name}; make it smaller"
            )
        global_batch_size = samples_per_step * dp
        total_steps = min(args.max_steps or steps_per_epoch * args.epochs, steps_per_epoch * args.epochs)
        # Batches on the device: the bundled data gathered there, a Dataset of yours through a DataLoader (--workers)
        seed = hash((args.seed, dp_rank))  # this group's workers' random streams
        train_batches = core.Batches(train_set, args.batch_size, device, dtype, args.workers, seed)
        test_batches = core.Batches(test_set, 512, device, dtype, args.workers)

        # ---- model: whole on every rank, from the seed: the initial weights of train_ddp.py, for any model ----
        # tensor_parallel and fully_shard below keep only this rank's part of each. (A model too big for one
        # device is built on the meta device instead: docs/fsdp.md says when and how.)
        torch.manual_seed(args.seed)
        channels, size = train_set[0][0].shape[:2]  # of one sample (C, H, W): BabyCNN's input
        model = BabyCNN(channels, data.NUM_CLASSES, size, args.width, device=device, dtype=dtype)
        if args.init_from:  # rank 0 reads the file, and broadcasts each weight to the others
            hardening.init_from(model, args.init_from)  # collective
        param_count = sum(p.numel() for p in model.parameters())
        flops = core.flops_per_sample(model, train_set, device, dtype)  # one sample's forward and backward

        # ---- wrap: split each pair of layers across the tp ranks, then shard what each holds over dp ----
        # bf16: gather and compute in bf16, reduce gradients in fp32, hand fp32 logits to the loss
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         output_dtype=torch.float32)
        parallelize(model, mesh, mp_policy if args.precision == "bf16" else MixedPrecisionPolicy())
        # The optimizer after the split: built before, it would hold the whole tensors the split replaced.
        peak_lr, warmup_steps, lr_at = core.lr_schedule(args, global_batch_size, total_steps)
        optimizer = core.make_optimizer(args, model.parameters())

        # ---- resume: every rank loads its part of the newest checkpoint in --checkpoint-dir, if any ----
        checkpointer = hardening.Checkpointer(args, dataset_name, global_batch_size, device)
        resumed = checkpointer.check_outputs_and_resume(model, optimizer, peak_lr, log)  # collective
        log(
            f"TP {args.tp} x FSDP {dp} (mesh (dp, tp) {tuple(mesh.shape)}) on {world_size} rank(s) "
            f"({backend}, {device.type}): batch {args.batch_size} per tp group x grad-accum {args.grad_accum} "
            f"x {dp} groups = global batch "
            f"{global_batch_size}; peak lr {peak_lr:g} after {warmup_steps} warmup steps; "
            f"{param_count:,} parameters; {flops / 1e6:,.1f} MFLOPs a sample; {args.precision}; {dataset_name}; "
            f"{total_steps} steps"
        )

        # ---- train loop ----
        progress = core.Progress(total_steps, global_batch_size, args.log_every, device, log, resumed["step"],
                                 args.log_dir)
        profiler = core.Profiler(args, rank, device, resumed["step"], total_steps)  # one line if it cannot
        window_loss, window_count = torch.zeros((), device=device), 0  # summed on the device: no per-step sync
        stop, stop_signal = hardening.StopSignals(rank, resumed["step"]), 0  # stop_signal: the one ranks agreed on
        test_loss = test_accuracy = None  # stay None with --no-eval
        first_epoch, first_step_in_epoch = resumed["epoch"], resumed["samples_into_epoch"] // global_batch_size
        for epoch in range(first_epoch, -(-total_steps // steps_per_epoch)):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
            model.train()
            progress.start_epoch(epoch)
            first = first_step_in_epoch if epoch == first_epoch else 0
            last = min(steps_per_epoch, first + total_steps - progress.step)
            batches = train_batches(list(sampler)[first * samples_per_step :])  # from where a resumed run stopped
            for step_in_epoch in range(first, last):
                optimizer.zero_grad(set_to_none=True)
                for micro_step in range(args.grad_accum):
                    images, labels = next(batches)
                    # Keep unsharded gradients local; the last micro-step's backward reduce-scatters their sum
                    last_micro_step = micro_step == args.grad_accum - 1
                    model.set_requires_gradient_sync(last_micro_step)
                    loss = F.cross_entropy(model(images), labels)
                    (loss / args.grad_accum).backward()  # the step's gradient is the mean over micro-steps
                    window_loss += loss.detach()
                    window_count += 1
                if args.max_grad_norm:
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    grad_norm = torch.nn.utils.get_total_norm(grads)  # of this rank's shards: a DTensor, "Partial"
                    grad_norm = grad_norm.full_tensor()  # collective: all-reduces the shards' norms into the global one
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.max_grad_norm, grad_norm)
                lr = lr_at(progress.step)  # a function of the step: resumes exactly
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                log_now = progress.update(end_of_epoch=step_in_epoch == last - 1)
                if log_now or stop.due(progress.step):  # and about once a second: the same steps on every rank
                    # A signal reaches the ranks at different steps: they compare here, and all stop at this one.
                    agreed = stop.proposal(device)  # [the signal received here or 0, -(steps to the next check)]
                    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                    stop_signal = stop.agree(agreed, progress.step)
                if log_now or stop_signal:
                    # One all-reduce per logging window, not per step: the mean loss over all ranks (a tp group's
                    # ranks hold the same loss, so the mean is the groups').
                    dist.all_reduce(window_loss)
                    mean_loss = window_loss.item() / (window_count * world_size)
                    if not math.isfinite(mean_loss):  # the same all-reduced value on every rank: all stop here
                        raise checkpointer.diverged(progress.step, f"the training loss is {mean_loss}")
                    norm = grad_norm.item() if args.max_grad_norm else None  # the last step's, before clipping
                    progress.record_loss(mean_loss, "loss (all ranks)", lr, norm)
                    window_loss.zero_()
                    window_count = 0
                profiler.after_step(progress.step)  # --profile-steps: starts or stops here
                # Also at the last step: a job requeued after it finished finds nothing left to train.
                last_step = progress.step == total_steps
                if args.checkpoint_dir and (stop_signal or last_step or progress.step % args.checkpoint_every == 0):
                    for buffer in model.buffers():  # each rank's own running statistics: rank 0's are saved
                        dist.broadcast(buffer, src=0)
                    position = {"epoch": epoch, "samples_into_epoch": (step_in_epoch + 1) * global_batch_size}
                    checkpointer.save(  # collective: all ranks; it refuses weights or a loss that are not finite
                        progress.step, position, model, optimizer, peak_lr, window_loss)
                if stop_signal and not last_step:  # at the last step it just finishes
                    stop.say_and_exit(stop_signal, progress.step, total_steps, args.checkpoint_dir)

            # ---- evaluate: each tp group scores a slice of the test set; the sums are all-reduced over dp ----
            if args.no_eval:
                continue
            for buffer in model.buffers():  # BatchNorm's running statistics, each rank's own: rank 0's, which it saves
                dist.broadcast(buffer, src=0)
            model.eval()
            totals = core.evaluate(model, test_batches, dp_rank, dp)  # each forward all-reduces in the tp group
            dist.all_reduce(totals, group=mesh.get_group("dp"))
            test_loss, test_accuracy = (totals[:2] / totals[2]).tolist()
            progress.record_test(test_loss, test_accuracy)  # --log-dir's row
            for module in model.modules():  # no backward follows these forwards to free what they gathered
                if isinstance(module, FSDPModule):  # (the last block; every block with grad-op)
                    module.reshard()
            log(
                f"epoch {epoch + 1}: step {progress.step}, train loss {progress.final_train_loss:.4f} (all ranks), "
                f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.2%}"
            )

        progress.close()  # the bar's last state stays on the screen

        # ---- save: every rank sends its shards; rank 0 gets the full state dict in CPU memory and writes ----
        if args.save:
            # torch 2.14 warns on every rank that it gathers a (dp, tp)-split tensor in two all-gathers, not one: the
            # same tensor, a little slower. Said once here instead.
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
            full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            hardening.on_rank_0(  # collective: whatever rank 0's write raises, every rank raises it
                lambda: core.save_state_dict(full_state, args.save), "writing --save")
            log(f"saved the weights to {args.save}")
        if args.metrics:  # every rank sends what it holds to rank 0, which writes the summary
            ranks = [None] * world_size
            dist.all_gather_object(ranks, {"rank": rank, **core.memory(model, optimizer, device)})
            if rank == 0:
                core.save_json({
                    "strategy": "tp", "tp": args.tp, "mesh": list(mesh.shape), "world_size": world_size,
                    "global_batch_size": global_batch_size,
                    **progress.summary(), "test_loss": test_loss, "test_accuracy": test_accuracy,
                    "param_count": param_count, "precision": args.precision, "dataset": dataset_name,
                    "peak_lr": peak_lr, "ranks": ranks,
                    **core.throughput(flops, progress.rate(), world_size, device, args.precision),
                }, args.metrics)
    finally:
        if progress:  # the CSV and TensorBoard's events are closed however the run ends
            progress.close()
        # torch 2.14's DTensor caches keep the mesh for good, and the mesh its group: let go of it (private; 2.9 has
        # none), or gloo's threads live into interpreter shutdown, where they may abort the process
        getattr(mesh, "_pg_registry", {}).clear()
        dist.destroy_process_group()


def parallelize(model, mesh, mp_policy):
    """TP inside each row of the (dp, tp) mesh, then FSDP2 down its columns: each rank keeps a 1/dp shard of its
    1/tp part of each weight."""
    tensor_parallel(model, mesh["tp"])
    for index, block in enumerate(model.blocks):
        # Backward starts with the last block: resharding it after forward would only gather it again.
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=index != len(model.blocks) - 1, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)


def tensor_parallel(model, tp_mesh):
    """Split BabyCNN's layers across the ranks of tp_mesh, in pairs. The first of a pair keeps 1/tp of its output
    channels (column-wise), so its output is split by channels; the second takes those channels in (row-wise) and
    adds up its partial outputs: one all-reduce in forward, and one for the pair's input gradient in backward.
    Each weight becomes a DTensor on tp_mesh: a checkpoint knows which part each rank holds."""
    group = tp_mesh.get_group()
    for block in model.blocks[:-1]:  # ConvBlock: conv1 -> ReLU -> conv2
        split_conv(block.conv1, tp_mesh, Shard(0), group)  # output channels
        split_conv(block.conv2, tp_mesh, Shard(1), group)  # input channels
    split_conv(model.blocks[-1].conv, tp_mesh, Shard(0), group)  # Head: conv -> ReLU -> flatten -> fc
    # torch's tensor-parallel API covers Linear: fc takes the flattened channels as they are split (Shard(-1)).
    fc = parallelize_module(model.blocks[-1].fc, tp_mesh, RowwiseParallel())
    # RowwiseParallel hands back a view of its DTensor's local tensor, which FSDP warns about: a copy of the logits
    fc.register_forward_hook(lambda module, inputs, output: output.clone())


def split_conv(conv, tp_mesh, weight_placement, group):
    """Keep this rank's part of conv's weight (by output channels, Shard(0), or input channels, Shard(1)) and
    bias, and give conv a forward that uses only that part."""
    column = weight_placement == Shard(0)
    bias_placement = Shard(0) if column else Replicate()  # row-wise: added once, to the summed output
    conv.weight = nn.Parameter(distribute_tensor(conv.weight.detach(), tp_mesh, [weight_placement]))
    conv.bias = nn.Parameter(distribute_tensor(conv.bias.detach(), tp_mesh, [bias_placement]))

    def forward(x):
        weight, bias = conv.weight.to_local(), conv.bias.to_local()
        if column:  # x is whole on every rank; backward sums its gradient's parts
            return F.conv2d(AllReduceBackward.apply(x, group), weight, bias, padding=conv.padding)
        partial = F.conv2d(x, weight, None, padding=conv.padding)  # this rank's input channels' share
        return AllReduceForward.apply(partial, group) + bias.view(1, -1, 1, 1)

    conv.forward = forward


class AllReduceForward(torch.autograd.Function):
    """Sum the tp ranks' partial outputs (Megatron's g); the gradient of a sum is the same for every part."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceBackward(torch.autograd.Function):
    """The identity on a tensor every tp rank holds whole (Megatron's f); each rank's layer used it for its own
    channels, so its gradient is the sum of the ranks' parts."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # all_reduce works in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


if __name__ == "__main__":
    hardening.run(main, data.DataError)  # one-line errors; under torchrun, die with it
