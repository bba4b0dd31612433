"""Train BabyCNN with Fully Sharded Data Parallel (FSDP2): each rank keeps only a shard of everything.

Launch (the README and run_fsdp.sh use the same commands):
    python train_fsdp.py                                      # one process, no torchrun
    torchrun --standalone --nproc-per-node=2 train_fsdp.py    # one node, 2 processes
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_fsdp.py  # two nodes: on each node
Through the wrapper: `bash run_fsdp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_fsdp.sh [flags]`.

What FSDP changes compared with train_ddp.py:
  setup  a device mesh: 1-D to shard over all ranks, 2-D (replicate x shard) for hybrid sharding
  wrap   fully_shard() on each block, then on the root: each rank keeps a shard of every
         parameter (the model is built whole, as in train_ddp.py, so any model's init is right)
  loop   set_requires_gradient_sync(False) instead of no_sync(); bf16 through MixedPrecisionPolicy
  save   get_model_state_dict(full_state_dict=True) gathers the shards; rank 0 writes them
Every collective is called here, or in a call marked "collective" (every rank must make it).
"""

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.data.distributed import DistributedSampler

from models import BabyCNN, data
from plumbing import core, hardening


def main():
    parser = core.parser(__doc__.splitlines()[0], data.add_arguments)
    parser.add_argument("--sharding", choices=("full", "grad-op", "hybrid"), default="full",
                        help="full: FULL_SHARD; grad-op: SHARD_GRAD_OP (keep gathered weights from forward to "
                        "backward); hybrid: HSDP, shard inside groups, replicate across them")
    parser.add_argument("--replicate-degree", type=core.number(int, 1), default=None,
                        help="hybrid only: number of replica groups (default: one per node)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="keep only each block's input for backward and recompute the rest there: less "
                        "activation memory for one more forward per block")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep shards and optimizer state in CPU memory (GPUs only)")
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
    else:  # plain `python train_fsdp.py`: a group of one, so every collective below runs unchanged
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank decides who logs and writes files
    progress = None
    mesh = None  # for the finally below, if setup fails before the mesh exists
    try:
        log = core.log if rank == 0 else (lambda line: None)  # above rank 0's progress bar

        # The device mesh FSDP shards over: every rank in one row, or R replica groups (rows) for hybrid.
        if args.sharding == "hybrid":
            replicas = args.replicate_degree or world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if world_size % replicas:
                raise core.UsageError(
                    f"--replicate-degree {replicas} must be a positive divisor of the world size {world_size}")
            mesh = init_device_mesh(device.type, (replicas, world_size // replicas),
                                    mesh_dim_names=("replicate", "shard"))
        elif args.replicate_degree is not None:
            raise core.UsageError(
                f"--replicate-degree applies to --sharding hybrid only, not --sharding {args.sharding}")
        else:
            mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
        if args.cpu_offload and device.type != "cuda":
            raise core.UsageError("--cpu-offload needs GPUs: it keeps shards in CPU memory for GPU compute, "
                                  "and here everything is on the CPU already")
        if args.cpu_offload and args.max_grad_norm:  # the shards' gradients, and so their norm, are in CPU memory
            raise core.UsageError("--max-grad-norm with --cpu-offload: the gradients' norm is on the CPU, where NCCL "
                                  "cannot all-reduce it; drop one of them")

        # ---- data: map-style Datasets (bundled: on the device); DistributedSampler deals this rank's share ----
        dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)  # collective
        # drop_last: without it, the sampler pads the shards to equal length by repeating samples, so some
        # would count twice in an epoch and no longer match one process on the whole set
        sampler = DistributedSampler(
            train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
        )
        samples_per_step = args.batch_size * args.grad_accum  # per rank, per optimizer step
        steps_per_epoch = len(sampler) // samples_per_step
        if steps_per_epoch == 0:
            raise core.UsageError(
                f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than the "
                f"{len(sampler)} samples each of the {world_size} ranks gets from {dataset_name}; make it smaller"
            )
        global_batch_size = samples_per_step * world_size
        total_steps = min(args.max_steps or steps_per_epoch * args.epochs, steps_per_epoch * args.epochs)
        # Batches on the device: the bundled data gathered there, a Dataset of yours through a DataLoader (--workers)
        train_batches = core.Batches(train_set, args.batch_size, device, dtype, args.workers, hash((args.seed, rank)))
        test_batches = core.Batches(test_set, 512, device, dtype, args.workers)

        # ---- model: whole on every rank, from the seed: the initial weights of train_ddp.py, for any model ----
        # fully_shard below keeps only this rank's shard of each. (A model too big for one device is built on the
        # meta device instead, and each shard initialised after sharding: docs/fsdp.md says when and how.)
        torch.manual_seed(args.seed)
        channels, size = train_set[0][0].shape[:2]  # of one sample (C, H, W): BabyCNN's input
        model = BabyCNN(channels, data.NUM_CLASSES, size, args.width, device=device, dtype=dtype)
        if args.init_from:  # rank 0 reads the file, and broadcasts each weight to the others
            hardening.init_from(model, args.init_from)  # collective
        param_count = sum(p.numel() for p in model.parameters())
        flops = core.flops_per_sample(model, train_set, device, dtype)  # one sample's forward and backward
        units = shard_units(model)  # [(parent, name)]: BabyCNN's 4 blocks
        if args.compile:  # each unit in place, so its class and parameter names stay (torchtitan compiles per block)
            for parent, name in units:
                getattr(parent, name).compile()
            log("--compile: each block, without CUDA graphs (FSDP frees and re-gathers weights each step; a graph cannot)")

        # ---- wrap: shard each block (one all-gather unit each), then the root ----
        fsdp_options = dict(
            mesh=mesh,
            # bf16: gather and compute in bf16, reduce gradients in fp32, hand fp32 logits to the loss
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
            if args.precision == "bf16" else MixedPrecisionPolicy(),
            offload_policy=CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy(),
        )
        reshard = args.sharding != "grad-op"  # grad-op keeps gathered weights from forward until backward
        for index, (parent, name) in enumerate(units):
            block = getattr(parent, name)
            if args.activation_checkpointing:
                # Keep only the block's input for backward, which recomputes the rest with the weights it gathers
                # anyway. Per block, before fully_shard, as torchtitan does; the wrapper's state-dict hooks drop
                # its "_checkpoint_wrapped_module." from parameter names, so files and checkpoints are unchanged.
                block = checkpoint_wrapper(block)
                setattr(parent, name, block)
            # Backward starts with the last block: resharding it after forward would only gather it again.
            fully_shard(block, reshard_after_forward=reshard and index != len(units) - 1, **fsdp_options)
        fully_shard(model, reshard_after_forward=reshard, **fsdp_options)
        peak_lr, warmup_steps, lr_at = core.lr_schedule(args, global_batch_size, total_steps)
        optimizer = core.make_optimizer(args, model.parameters())

        # ---- resume: every rank loads its part of the newest checkpoint in --checkpoint-dir, if any ----
        checkpointer = hardening.Checkpointer(args, dataset_name, global_batch_size, device)
        resumed = checkpointer.check_outputs_and_resume(model, optimizer, peak_lr, log)  # collective
        recompute = ", activation checkpointing" if args.activation_checkpointing else ""
        log(
            f"FSDP ({args.sharding}{recompute}, mesh {tuple(mesh.shape)}) on {world_size} rank(s) "
            f"({backend}, {device.type}): "
            f"batch {args.batch_size} per rank x grad-accum {args.grad_accum} x {world_size} ranks = global batch "
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
                    # One all-reduce per logging window, not per step: the mean loss over all ranks.
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

            # ---- evaluate: each rank scores a slice of the test set; the sums are all-reduced ----
            if args.no_eval:
                continue
            for buffer in model.buffers():  # BatchNorm's running statistics, each rank's own: rank 0's, which it saves
                dist.broadcast(buffer, src=0)
            model.eval()
            totals = core.evaluate(model, test_batches, rank, world_size)  # each forward all-gathers: every rank
            dist.all_reduce(totals)
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
            full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            hardening.on_rank_0(  # collective: whatever rank 0's write raises, every rank raises it
                lambda: core.save_state_dict(full_state, args.save), "writing --save")
            log(f"saved the weights to {args.save}")
        if args.metrics:  # every rank sends what it holds to rank 0, which writes the summary
            ranks = [None] * world_size
            dist.all_gather_object(ranks, {"rank": rank, **core.memory(model, optimizer, device)})
            if rank == 0:
                core.save_json({
                    "strategy": "fsdp", "sharding": args.sharding,
                    "activation_checkpointing": args.activation_checkpointing,
                    "mesh": list(mesh.shape), "world_size": world_size, "global_batch_size": global_batch_size,
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


def shard_units(model):
    """The submodules fully_shard makes units of, as (parent, name): each child of the model that has parameters, and
    for a child that is a list of layers (nn.Sequential, nn.ModuleList: BabyCNN's blocks, a ResNet's stages), each
    layer in it. Forward gathers one unit's weights at a time; the rest is sharded with the root."""
    def has_parameters(module):
        return next(module.parameters(), None) is not None

    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            units += [(child, n) for n, layer in child.named_children() if has_parameters(layer)]
        elif has_parameters(child):
            units.append((model, name))
    return units


if __name__ == "__main__":
    hardening.run(main, data.DataError)  # one-line errors; under torchrun, die with it
