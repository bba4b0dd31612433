"""--profile-steps A:B: each rank's trace of steps A to B, in --log-dir (opt-in: imported only when
the flag is given, so a copy without this file refuses the flag in one line)."""

import os

import torch
import torch.distributed as dist

from plumbing.failures import UsageError


class Profiler:
    """Starts after step A - 1 and writes trace-rank<N>.json after step B (watch.Progress calls
    ``after_step`` once each step's collectives are done); on a GPU, the memory timeline too."""

    def __init__(self, args, device, start_step, total_steps, log):  # log: watch.log
        self.first, self.last = args.profile_steps
        if not (args.log_dir and self.last <= total_steps):
            raise UsageError(
                f"--profile-steps {self.first}:{self.last} needs --log-dir, for the traces, and "
                f"steps from 1 to this run's {total_steps}"
            )
        if start_step >= self.first:  # an earlier attempt wrote them
            past = f"resumed at step {start_step}, past step {self.first}"
            log(f"--profile-steps: {past}: no new trace")
            self.first, self.last = 0, -1
        self.path = os.path.join(args.log_dir, f"trace-rank{dist.get_rank()}")
        self.device = device
        activities = [torch.profiler.ProfilerActivity.CPU]
        gpu = device.type == "cuda"
        activities += [torch.profiler.ProfilerActivity.CUDA] if gpu else []
        self.profile = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=gpu, with_stack=gpu
        )
        self.after_step(start_step)

    def after_step(self, done):  # done: the optimizer steps finished
        if done == self.first - 1:
            self.profile.start()
        if done == self.last:
            if self.device.type != "cpu":  # the step's kernels end inside the trace
                torch.accelerator.synchronize()
            self.profile.stop()
            self.profile.export_chrome_trace(self.path + ".json")
            if self.device.type == "cuda":
                self.profile.export_memory_timeline(self.path + "-memory.html", str(self.device))
