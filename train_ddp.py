"""Train a model with DistributedDataParallel (DDP): a full replica per rank, gradients all-reduced.

Launch (the README and run_ddp.sh use the same commands):
    python train_ddp.py                                       # one process, no torchrun
    torchrun --standalone --nproc-per-node=2 train_ddp.py     # one node, 2 processes
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_ddp.py   # on each node
Through the wrapper: `bash run_ddp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_ddp.sh [flags]`.

What DDP adds to a one-process loop:
  setup  a process group: NCCL on GPUs, gloo on CPUs
  data   DistributedSampler: each rank a disjoint shard of the epoch's order
  wrap   DDP(model): rank 0's weights everywhere; backward all-reduces gradients
  loop   no_sync() on all but the last micro-step of accumulation
  save   rank 0 writes the plain model's weights (the wrapper's .module)
Every collective is called here, or in a call marked "collective".
"""

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import models
from models import data
from plumbing import failures, outputs, training, watch
from plumbing.training import START
from plumbing.watch import log


def main():
    parser = training.parser(__doc__.splitlines()[0], data.add_arguments)
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the device
    device = training.pick_device(args, local_rank)
    # Before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download, model=args.model)
    backend = dist.get_default_backend_for_device(device)  # NCCL or gloo
    dist.init_process_group(backend, **failures.process_group_options(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype, autocast = training.dtype_of(args), training.autocast(args, device)

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

    # ---- model: the same initial weights on every rank, from the seed ----
    torch.manual_seed(args.seed)
    model = models.build(args, train_set, device, dtype)  # --model, for the data
    torch.manual_seed(args.seed + rank)  # then dropout: each rank its own masks, for its samples
    if args.init_from:
        from plumbing import init_from

        init_from.load(model, args.init_from, log)  # collective
    param_count = sum(p.numel() for p in model.parameters())
    training.check_data_fits(model, train_batches, test_batches)  # bad data: one line, now
    flops = watch.flops_per_sample(model, next(test_batches([0]))[0])
    keep_grads = compile_model(model, args, device)  # --compile

    # ---- wrap: a full replica here; DDP averages gradients across ranks ----
    ddp_model = wrap_ddp(model, device, world_size)
    no_sync = ddp_model.no_sync if world_size > 1 else nullcontext
    optimizer = training.make_optimizer(args, model.parameters())

    # ---- resume: from the newest checkpoint, if any ----
    resumed = checkpoints.resume(model, optimizer, log) if checkpoints else START  # collective
    what = f"DDP on {world_size} rank(s)" if world_size > 1 else "one process, no DDP wrapper"
    log(f"{what} ({backend}, {device.type}): {watch.describe(args, plan, param_count, flops)}")

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
            optimizer.zero_grad(set_to_none=not keep_grads)
            for micro_step in range(args.grad_accum):
                images, labels = next(batches)
                # no_sync: local gradients; the last micro-step all-reduces the sum
                last_micro_step = micro_step == args.grad_accum - 1
                with nullcontext() if last_micro_step else no_sync():
                    with autocast:  # logits (..., C), targets (...)
                        loss = F.cross_entropy(ddp_model(images).flatten(0, -2), labels.flatten())
                    (loss / args.grad_accum).backward()  # the mean over micro-steps
                window.append(loss.detach())
            if args.max_grad_norm:  # gradients all-reduced: one global norm
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
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
            test_loss, test_accuracy = evaluate(model, test_batches, autocast)
            progress.record_test(test_loss, test_accuracy)
    progress.close()

    # ---- save: rank 0 writes the plain model's weights (no "module.") ----
    if args.save:
        outputs.save_on_rank_0(model.state_dict(), args.save)  # collective
        log(f"saved the weights to {args.save}")
    if hasattr(train_set, "vocabulary") and failures.is_rank_0():  # text: a sample
        log(models.sample(model, model.state_dict(), train_set.vocabulary))  # the replica is whole
    if args.metrics:  # collective: rank 0 gathers each rank's memory
        from plumbing import metrics

        run = {"strategy": "ddp"}
        metrics.write(args, plan, progress, model, optimizer, flops, param_count, **run)


def compile_model(model, args, device):
    """--compile: the whole model in place (names stay); BabyCNN with CUDA graphs on one GPU.

    CUDA graphs measured 1.9 x eager for BabyCNN's many small kernels, but the GPT ran at
    0.45 x: other models take torch's default mode, as nanoGPT's. A graph's replay reuses
    its outputs' memory: gradients summed over micro-steps need buffers of their own,
    kept and zeroed. Returns whether they are kept.
    """
    if not args.compile:
        return False
    graphs = device.type == "cuda" and getattr(args, "model", None) == "cnn"  # a copy: none
    # never run under DDP (pytorch issue 128218); a test's process may have no group
    graphs &= not dist.is_initialized() or dist.get_world_size() == 1
    model.compile(mode="reduce-overhead" if graphs else None, dynamic=False)  # static shapes
    keep_grads = graphs and args.grad_accum > 1
    for p in model.parameters() if keep_grads else ():
        p.grad = torch.zeros_like(p)
    return keep_grads


def wrap_ddp(model, device, world_size):
    """DDP around ``model``, or the plain model alone on one process.

    One process has nothing to average (benchmarks/bare_loop.py --ddp measures
    what DDP's hooks cost). Gradients become views of DDP's buckets.
    """
    if world_size == 1:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)


def evaluate(model, test_batches, autocast):
    """Collective: the test loss and accuracy, with rank 0's statistics."""
    for buffer in model.buffers():  # BatchNorm's: rank 0's, as saved
        dist.broadcast(buffer, src=0)
    model.eval()
    with autocast:  # loss sum, correct, count on this rank
        totals = training.evaluate(model, test_batches, dist.get_rank(), dist.get_world_size())
    dist.all_reduce(totals)
    return (totals[:2] / totals[2]).tolist()


if __name__ == "__main__":
    failures.run(main, data.DataError)  # one-line errors, exit codes
