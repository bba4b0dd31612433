"""Train BabyCNN with DistributedDataParallel (DDP): a full replica per rank, gradients all-reduced.

Launch (the README and run_ddp.sh use the same commands):
    python train_ddp.py                                       # one process, no torchrun
    torchrun --standalone --nproc-per-node=2 train_ddp.py     # one node, 2 processes
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_ddp.py   # two nodes: on each node
Through the wrapper: `bash run_ddp.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_ddp.sh [flags]`.

What DDP changes compared with one process:
  setup  every process joins a process group (NCCL on GPUs, gloo on CPUs)
  data   DistributedSampler hands each rank a disjoint shard of each epoch's shuffled order
  wrap   DDP(model) broadcasts rank 0's weights, then all-reduces gradients during backward (on one
         process there is nothing to average: the plain model trains alone, without DDP's per-step cost)
  loop   no_sync() skips that all-reduce on all but the last micro-step of gradient accumulation
  save   only rank 0 writes the plain model's weights (the wrapper's .module)
Every collective is called here, or in a call marked "collective" (every rank must make it).
"""

import math
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from models import BabyCNN, data
from plumbing import core, hardening


def main():
    parser = core.parser(__doc__.splitlines()[0], data.add_arguments)
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # rank on this node: picks the GPU
    if core.use_cuda(args.device, local_rank):  # --device; one line if this node has too few GPUs
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dtype, autocast = core.precision(args, device)  # the weights' dtype; bf16 autocast for the forward, or nothing
    # Find (or download) the data before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download)
    timeout = timedelta(minutes=10)  # a collective that waits longer than this fails instead of hanging
    if "RANK" in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        store = hardening.store_for_this_attempt(timeout)  # torchrun's, this restart's own part (None: env://)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), timeout=timeout,
                                world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    else:  # plain `python train_ddp.py`: a group of one, so every collective below runs unchanged
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank decides who logs and writes files
    progress = None
    try:
        log = core.log if rank == 0 else (lambda line: None)  # above rank 0's progress bar

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

        # ---- model: the same initial weights on every rank, from the seed ----
        torch.manual_seed(args.seed)
        channels, size = train_set[0][0].shape[:2]  # of one sample (C, H, W): BabyCNN's input
        model = BabyCNN(channels, data.NUM_CLASSES, size, args.width, device=device, dtype=dtype)
        if args.init_from:  # rank 0 reads the file, and broadcasts each weight to the others
            hardening.init_from(model, args.init_from)  # collective
        param_count = sum(p.numel() for p in model.parameters())
        flops = core.flops_per_sample(model, train_set, device, dtype)  # one sample's forward and backward
        if args.compile:  # the whole model in place (names stay); on a GPU, CUDA graphs: a step's kernels in one launch
            model.compile(mode="reduce-overhead" if device.type == "cuda" else None)
        # A CUDA graph's next replay reuses its outputs' memory, so gradients summed over micro-steps need buffers
        # of their own, zeroed each step instead of freed.
        keep_grads = args.compile and device.type == "cuda" and args.grad_accum > 1
        for p in model.parameters() if keep_grads else ():
            p.grad = torch.zeros_like(p)

        # ---- wrap: DDP keeps a full replica here and averages gradients across ranks ----
        # One process has nothing to average: the plain model trains alone (benchmarks/bare_loop.py --ddp measures
        # what DDP's hooks would cost it). DDP broadcasts rank 0's weights; gradients become views of its buckets.
        ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True) if world_size > 1 else model
        no_sync = ddp_model.no_sync if world_size > 1 else nullcontext
        peak_lr, warmup_steps, lr_at = core.lr_schedule(args, global_batch_size, total_steps)
        optimizer = core.make_optimizer(args, model.parameters())

        # ---- resume: every rank loads its part of the newest checkpoint in --checkpoint-dir, if any ----
        checkpointer = hardening.Checkpointer(args, dataset_name, global_batch_size, device)
        resumed = checkpointer.check_outputs_and_resume(model, optimizer, peak_lr, log)  # collective
        log(
            f"{f'DDP on {world_size} rank(s)' if world_size > 1 else 'one process, no DDP wrapper'} ({backend}, {device.type}): "
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
                optimizer.zero_grad(set_to_none=not keep_grads)
                for micro_step in range(args.grad_accum):
                    images, labels = next(batches)
                    # no_sync: keep gradients local; the last micro-step's backward all-reduces their sum
                    last_micro_step = micro_step == args.grad_accum - 1
                    with nullcontext() if last_micro_step else no_sync():
                        with autocast:
                            loss = F.cross_entropy(ddp_model(images), labels)
                        (loss / args.grad_accum).backward()  # the step's gradient is the mean over micro-steps
                    window_loss += loss.detach()
                    window_count += 1
                if args.max_grad_norm:  # the gradients are all-reduced: each rank computes the same global norm
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
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
            with autocast:
                totals = core.evaluate(model, test_batches, rank, world_size)  # loss sum, correct, count on this rank
            dist.all_reduce(totals)
            test_loss, test_accuracy = (totals[:2] / totals[2]).tolist()
            progress.record_test(test_loss, test_accuracy)  # --log-dir's row
            log(
                f"epoch {epoch + 1}: step {progress.step}, train loss {progress.final_train_loss:.4f} (all ranks), "
                f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.2%}"
            )

        progress.close()  # the bar's last state stays on the screen

        # ---- save: rank 0 writes the plain model's weights (not the wrapper's: no "module." prefix) ----
        if args.save:
            hardening.on_rank_0(  # collective: whatever rank 0's write raises, every rank raises it
                lambda: core.save_state_dict(model.state_dict(), args.save), "writing --save")
            log(f"saved the weights to {args.save}")
        if args.metrics:  # every rank sends what it holds to rank 0, which writes the summary
            ranks = [None] * world_size
            dist.all_gather_object(ranks, {"rank": rank, **core.memory(model, optimizer, device)})
            if rank == 0:
                core.save_json({
                    "strategy": "ddp", "world_size": world_size, "global_batch_size": global_batch_size,
                    **progress.summary(), "test_loss": test_loss, "test_accuracy": test_accuracy,
                    "param_count": param_count, "precision": args.precision, "dataset": dataset_name,
                    "peak_lr": peak_lr, "ranks": ranks,
                    **core.throughput(flops, progress.rate(), world_size, device, args.precision),
                }, args.metrics)
    finally:
        if progress:  # the CSV and TensorBoard's events are closed however the run ends
            progress.close()
        ddp_model = no_sync = None  # DDP holds the group: let go first, and destroy_process_group ends gloo's threads
        dist.destroy_process_group()


if __name__ == "__main__":
    hardening.run(main, data.DataError)  # one-line errors; under torchrun, die with it
