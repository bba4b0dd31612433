"""How long --model gpt takes to reach a validation loss of 1.9 through the launcher: the README's
command as a user types it, `bash run_ddp.sh --model gpt`, on 2 CPU processes of one thread each.

    python docs/gpt_time_to_loss.py                      # the default recipe, 2 processes
    python docs/gpt_time_to_loss.py -- --max-steps 700   # flags after -- go to the script

Prints, and writes to --out as JSON: the wall seconds from the launch to each evaluation's line
(start-up included: bash, torchrun, imports, the data) and to the first at or below --target; the
CPU seconds the launch's processes had used by then (all of them together, and the busiest rank's);
the final validation loss; the load average of the machine before, during and after (a shared
machine stretches the wall clock, not the CPU seconds: on a machine of its own with a core per rank,
the wall clock is about the start-up plus the busiest rank's CPU seconds); whether the trained model
wrote its text. The scripts evaluate at each epoch's end and at the last step.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
EVAL = re.compile(r"^epoch (\d+): step (\d+), .*test loss ([\d.]+)")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--target", type=float, default=1.9, help="the validation loss to reach")
parser.add_argument("--ranks", type=int, default=2, help="NPROC_PER_NODE")
parser.add_argument("--out", type=Path, default=ROOT / "docs/results/gpt_time_to_loss.json")
parser.add_argument("flags", nargs="*", help="more flags for train_ddp.py, after --")
args = parser.parse_args()


class CPUClock:
    """The CPU seconds (user + system) of a process and all below it, read from /proc about every
    half second; a process that ended keeps its last reading."""

    def __init__(self, pid):
        self.pid, self.seconds, self.loads, self.done = pid, {}, [], False
        self.ranks = {}
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self):
        while not self.done:
            self.read()
            self.loads.append(os.getloadavg()[0])
            time.sleep(0.5)

    def read(self):
        parents = {}
        for entry in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if entry.isdigit():
                fields = stat.rsplit(")", 1)[1].split()
                parents[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS)
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            frontier = [pid for pid, (parent, _) in parents.items() if parent in frontier]
            tree.update(frontier)
        for pid in tree & parents.keys():
            self.seconds[pid] = max(self.seconds.get(pid, 0.0), parents[pid][1])
            if not self.ranks.get(pid):  # torchrun's workers: the only ones with a LOCAL_RANK
                try:
                    self.ranks[pid] = b"\0LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    self.ranks[pid] = False
        ranks = [seconds for pid, seconds in self.seconds.items() if self.ranks[pid]]
        return round(sum(self.seconds.values()), 1), round(max(ranks, default=0.0), 1)


command = ["bash", str(ROOT / "run_ddp.sh"), "--model", "gpt", *args.flags]
env = {**os.environ, "NPROC_PER_NODE": str(args.ranks), "OMP_NUM_THREADS": "1"}
env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # launch.sh's python3: this
load_before = os.getloadavg()
started = time.monotonic()
process = subprocess.Popen(
    command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
)
clock = CPUClock(process.pid)
evaluations, lines, reached, start = [], [], None, None
for line in process.stdout:
    lines.append(line.rstrip("\n"))
    if start is None and " rank(s) " in line:  # the start line: the ranks are about to train
        start = {"wall_seconds": round(time.monotonic() - started, 1), "line": lines[-1]}
        start["cpu_seconds_all"], start["cpu_seconds_busiest_process"] = clock.read()
    if match := EVAL.match(line):
        cpu_all, cpu_busiest = clock.read()
        point = {
            "epoch": int(match[1]),
            "step": int(match[2]),
            "val_loss": float(match[3]),
            "wall_seconds": round(time.monotonic() - started, 1),
            "cpu_seconds_all": cpu_all,
            "cpu_seconds_busiest_process": cpu_busiest,
        }
        evaluations.append(point)
        print(json.dumps(point), flush=True)
        if reached is None and point["val_loss"] <= args.target:
            reached = point
returncode = process.wait()
wall = time.monotonic() - started
cpu_all, cpu_busiest = clock.read()
clock.done = True
if returncode != 0 or not evaluations or start is None:
    sys.exit(f"the launch failed (exit code {returncode}):\n" + "\n".join(lines[-20:]))
loads = clock.loads or [load_before[0]]
result = {
    "command": "NPROC_PER_NODE={} OMP_NUM_THREADS=1 bash run_ddp.sh --model gpt{}".format(
        args.ranks, "".join(f" {flag}" for flag in args.flags)
    ),
    "start": start,  # the start line, and the wall and CPU seconds that start-up took
    "target": args.target,
    "reached": reached is not None,
    "wall_seconds_to_target": reached and reached["wall_seconds"],
    "cpu_seconds_to_target_busiest_process": reached and reached["cpu_seconds_busiest_process"],
    "final_val_loss": evaluations[-1]["val_loss"],
    "wall_seconds": round(wall, 1),
    "cpu_seconds_all": cpu_all,
    "cpu_seconds_busiest_process": cpu_busiest,
    "load_average_1min": {
        "before": round(load_before[0], 2),
        "during_mean": round(sum(loads) / len(loads), 2),
        "after": round(os.getloadavg()[0], 2),
    },
    "cores": os.cpu_count(),
    "commit": subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip(),
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "torch": version("torch"),
    "wrote_text": any("the trained GPT writes" in line for line in lines),
    "evaluations": evaluations,
}
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "evaluations"}), flush=True)
target = (
    f"{result['wall_seconds_to_target']} s from the launch to validation loss {args.target} "
    f"(the busiest rank's CPU: {result['cpu_seconds_to_target_busiest_process']} s)"
    if reached
    else f"validation loss {args.target} not reached"
)
print(
    f"gpt_time_to_loss: {target}; final {result['final_val_loss']} in {result['wall_seconds']} s; "
    f"load {result['load_average_1min']['during_mean']} on {result['cores']} cores; "
    f"wrote {args.out}"
)
