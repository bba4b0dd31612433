"""Train a model with Fully Sharded Data Parallel (FSDP2): each rank keeps a shard of everything.

Launch (the README and run_fsdp.sh use the same commands):
    python train_fsdp.py                                      # one process, no torchrun
    torchrun --standalone --nproc-per-node=2 train_fsdp.py    # one node, 2 processes
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_fsdp.py  # on each node
Through the wrapper: `bash run_fsdp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_fsdp.sh [flags]`.

What FSDP changes compared with train_ddp.py:
  setup  a device mesh: 1-D (shard), or 2-D (replicate x shard) for hybrid
  model  built on meta: a rank allocates and fills only its shards (plumbing/parts.py)
  wrap   fully_shard() on each block, then the root: a rank keeps a shard of
         each parameter
  loop   set_requires_gradient_sync(False), not no_sync(); MixedPrecisionPolicy
  save   get_model_state_dict(full_state_dict=True) gathers; rank 0 writes
Every collective is called here, or in a call marked "collective".
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.data.distributed import DistributedSampler

import models
from models import data
from plumbing import failures, outputs, parts, training, watch
from plumbing.training import START
from plumbing.watch import log


def main():
    parser = training.parser(__doc__.splitlines()[0], data.add_arguments)
    add_arguments(parser)
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the device
    device = training.pick_device(args, local_rank)
    check_flags(args, device)
    # Before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download, model=args.model)
    backend = dist.get_default_backend_for_device(device)  # NCCL or gloo
    dist.init_process_group(backend, **failures.process_group_options(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = training.dtype_of(args)  # bf16: MixedPrecisionPolicy
    mesh = make_mesh(args, device, world_size)  # 2-D for hybrid
    # ---- data: the sampler deals each rank its share ----
    # collective: all ranks train on the same data
    dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)
    # drop_last: no samples repeated to pad the shards
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed, drop_last=True)
    plan = training.Plan(args, len(sampler), world_size, dataset_name)
    outputs.check(args)  # collective: fails now, not after training
    if checkpointing := args.checkpoint_dir or args.resume_from:  # opt-in: imported only then
        from plumbing import checkpoint_dir
    checkpoints = checkpoint_dir.Checkpoints(args, plan, device) if checkpointing else None
    seed = hash((args.seed, rank))  # for this rank's DataLoader workers
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

    # ---- wrap: shard each block (one all-gather unit each), then the root ----
    units = shard(model, args, mesh)  # in words, for the start line
    parts.materialize(model, device, args, fill, log)  # collective: each rank fills its part
    optimizer = training.make_optimizer(args, model.parameters())
    torch.manual_seed(args.seed + rank)  # the weights filled: each rank its own dropout masks

    # ---- resume: from the newest checkpoint, if any ----
    resumed = checkpoints.resume(model, optimizer, log) if checkpoints else START  # collective
    recompute = ", activation checkpointing" if args.activation_checkpointing else ""
    what = f"FSDP ({args.sharding}{recompute}, mesh {tuple(mesh.shape)}, {units})"
    figures = f"{watch.describe(args, plan, param_count, flops)}; {parts.BUILT[fill]}"
    log(f"{what} on {world_size} rank(s) ({backend}, {device.type}): {figures}")

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
                # logits (..., C), targets (...)
                loss = F.cross_entropy(model(images).flatten(0, -2), labels.flatten())
                (loss / args.grad_accum).backward()  # the mean over micro-steps
                window.append(loss.detach())
            if args.max_grad_norm:  # collective: the shards' global norm
                norm = clip_grad_norm(model, args.max_grad_norm)
            lr = plan.lr(progress.step)
            training.set_lr(optimizer, lr)
            optimizer.step()
            progress.count_step()
            log_now = progress.is_logging_step(end_of_epoch=step_in_epoch == last - 1)
            # collective, about once a second: the ranks agree on a stop
            stop_signal = stop.agree_now(progress.step, log_now, device)
            if log_now or stop_signal:  # one all-reduce per window
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

        # ---- evaluate: each rank scores a slice; the sums are all-reduced ----
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

        run = {"strategy": "fsdp", "sharding": args.sharding, "mesh": list(mesh.shape)}
        run |= {"activation_checkpointing": args.activation_checkpointing}
        metrics.write(args, plan, progress, model, optimizer, flops, param_count, **run)
    # Let go of the mesh, which torch 2.14's DTensor caches keep (private; not in 2.9):
    # else gloo's threads live into shutdown, where they may abort.
    getattr(mesh, "_pg_registry", {}).clear()


def add_arguments(parser):  # FSDP's flags
    add = parser.add_argument
    add(
        "--sharding",
        choices=("full", "grad-op", "hybrid"),
        default="full",
        help="full: FULL_SHARD; grad-op: SHARD_GRAD_OP (keep gathered weights from forward to "
        "backward); hybrid: HSDP, shard inside groups, replicate across them",
    )
    add(
        "--replicate-degree",
        type=training.number(int, 1),
        help="hybrid only: number of replica groups (default: one per node)",
    )
    add(
        "--activation-checkpointing",
        action="store_true",
        help="keep only each block's input for backward and recompute the rest there",
    )
    add("--cpu-offload", action="store_true", help="keep shards and optimizer state in CPU memory")


def check_flags(args, device):
    """Refuse FSDP's flags that do not go together, before anything is built."""
    if args.cpu_offload and device.type != "cuda":
        raise failures.UsageError(
            "--cpu-offload needs GPUs: it keeps shards in CPU memory for GPU compute, "
            "and here everything is on the CPU already"
        )
    if args.replicate_degree is not None and args.sharding != "hybrid":
        raise failures.UsageError(
            f"--replicate-degree applies to --sharding hybrid only, not --sharding {args.sharding}"
        )
    if args.cpu_offload and args.max_grad_norm:  # gradients in CPU memory
        raise failures.UsageError(
            "--max-grad-norm with --cpu-offload: the gradients' norm is on the CPU, where NCCL "
            "cannot all-reduce it; drop one of them"
        )


def gather_full_state_dict(model):
    """Collective: rank 0 gets the whole state dict, in CPU memory."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def make_mesh(args, device, world_size):
    """The mesh FSDP shards over: all ranks in one row, or a row per replica group."""
    if args.sharding != "hybrid":
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    replicas = args.replicate_degree or world_size // local_world_size
    if world_size % replicas:
        raise failures.UsageError(
            f"--replicate-degree {replicas} must be a positive divisor of the world size "
            f"{world_size}"
        )
    shape = (replicas, world_size // replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def shard(model, args, mesh):
    """Each unit checkpointed (--activation-checkpointing), compiled (--compile) and sharded
    (an all-gather each), then the root; the units in words."""
    units, words = parts.shard_units(model)  # [(parent, name)]: BabyCNN's 4 blocks
    if args.compile:
        log("--compile: each block, without CUDA graphs (FSDP frees and re-gathers weights)")
    mp_policy = root_policy = MixedPrecisionPolicy()
    if args.precision == "bf16":  # reduce in fp32; bf16 between units, for the root's own modules
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)  # logits
    offload = CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    reshard = args.sharding != "grad-op"  # grad-op keeps weights gathered to backward
    for index, (parent, name) in enumerate(units):
        block = getattr(parent, name)
        if args.activation_checkpointing:
            # Keep only the block's input: backward recomputes the rest with the weights
            # it gathers anyway. The wrapper's state-dict hooks keep parameter names.
            block = checkpoint_wrapper(block)
            setattr(parent, name, block)
        # Checkpointing, compile, fully_shard: torchtitan's order. The compiled graph holds the
        # recomputation, and FSDP's gathers stay hooks around it. In place: names stay.
        if args.compile:
            compile_outside(block, {getattr(p, n) for p, n in units[:index]})
        # Backward starts with the last block: resharding it would only regather.
        last = index == len(units) - 1
        fully_shard(block, reshard_after_forward=reshard and not last, **options)
    fully_shard(model, reshard_after_forward=reshard, **options | {"mp_policy": root_policy})
    return words


def compile_outside(module, units):
    """module.compile(), or, if it holds units (the GPT's list of layers, a unit for the tied
    embedding and head), each child outside them: dynamo skips FSDP's hooks, so a graph around a
    unit would break at them."""
    if not any(m in units for m in module.modules()):
        return module.compile(dynamic=False)  # static shapes; the evaluation runs eager
    for child in module.children():
        if child not in units:
            compile_outside(child, units)


def clip_grad_norm(model, max_norm):
    """Collective: clip the sharded gradients to their global norm; returns it, before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)  # of the shards: "Partial"
    norm = norm.full_tensor()  # collective: all-reduced
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def evaluate(model, test_batches, mesh):
    """Collective: the test loss and accuracy, with rank 0's statistics."""
    for buffer in model.buffers():  # BatchNorm's: rank 0's, as saved
        dist.broadcast(buffer, src=0)
    model.eval()
    # Loss sum, correct, count here; each forward all-gathers: every rank runs it.
    totals = training.evaluate(model, test_batches, dist.get_rank(), dist.get_world_size())
    dist.all_reduce(totals)
    for module in model.modules():  # no backward frees what these gathered
        if isinstance(module, FSDPModule):  # the last block (all with grad-op)
            module.reshard()
    return (totals[:2] / totals[2]).tolist()


if __name__ == "__main__":
    failures.run(main, data.DataError)  # one-line errors, exit codes
