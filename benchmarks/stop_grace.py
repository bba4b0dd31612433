"""How far apart the copies of one preemption's stop signal arrive: what failures.STOP_GRACE must
cover (a second signal within it is the same stop).

    python benchmarks/stop_grace.py --repeats 3

`bash run_ddp.sh` on 2 CPU processes (bundled MNIST), stopped after its step-20 checkpoint by one
SIGTERM, sent as a cluster sends it: to GNU `timeout` around the launch (it passes the signal to
its child, then to the child's process group), or to the launcher and both workers at once
(scancel, a pod's deletion; each worker then also gets torchrun's copy). strace, attached to the
launcher and the workers before the signal, records each delivery's time and sender; the figure is
the largest gap between the first and the last copy a process received, and the latest copy's
delay after the send (a worker's copy from torchrun comes that late: the gap it can make after a
copy sent to the worker directly). Two copies that arrive while one is pending merge into one.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DELIVERY = re.compile(r"^(?:\[pid +\d+\] )?(\d+\.\d+) --- SIGTERM \{.*si_pid=(\d+)")


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as file:
                if int(file.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def workers(launcher):  # torchrun's workers: its children that run the training script
    return [
        p for p in children(launcher) if b"train_ddp" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]


def one_stop(sender, folder):
    command = ["bash", str(ROOT / "run_ddp.sh"), "--batch-size", "16", "--max-steps", "5000"]
    command += ["--log-every", "100000", "--checkpoint-every", "20", "--no-eval"]
    command += ["--checkpoint-dir", str(folder / "ck")]
    if sender == "gnu-timeout":
        command = ["timeout", "600", *command]
    env = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    while not (folder / "ck" / "step-20").exists():
        if run.poll() is not None:
            sys.exit(run.stdout.read().decode())
        time.sleep(0.05)
    launcher = children(run.pid)[0] if sender == "gnu-timeout" else run.pid
    watched = [launcher, *workers(launcher)]
    traces = [
        subprocess.Popen(
            ["strace", "-f", "-ttt", "-e", "trace=none", "-e", "signal=SIGTERM", "-p", str(pid)],
            stderr=subprocess.PIPE,
        )
        for pid in watched
    ]
    time.sleep(1)  # attached
    sent = time.time()
    for pid in [run.pid] if sender == "gnu-timeout" else watched:
        os.kill(pid, signal.SIGTERM)
    output = run.communicate(timeout=120)[0].decode()
    gaps = []
    for pid, trace in zip(watched, traces):
        trace.send_signal(signal.SIGINT)  # detaches, if the process lives on
        times = [
            float(m[1])
            for m in map(DELIVERY.match, trace.communicate()[1].decode().split("\n"))
            if m
        ]
        gap = max(times) - min(times) if times else 0
        delay = max(times) - sent if times else None
        gaps.append({"pid": pid, "copies": len(times), "gap_s": gap, "delay_s": delay})
    return {"sender": sender, "exit_code": run.returncode, "again": "again" in output, "gaps": gaps}


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
results = []
for _ in range(args.repeats):
    for sender in ("gnu-timeout", "launcher-and-workers"):
        with tempfile.TemporaryDirectory() as folder:
            results.append(one_stop(sender, Path(folder)))
            print(json.dumps(results[-1]), flush=True)
gaps = [gap for result in results for gap in result["gaps"]]
largest = {"largest_gap_s": max(gap["gap_s"] for gap in gaps)}
largest["latest_delay_s"] = max(gap["delay_s"] or 0 for gap in gaps)
print(json.dumps(largest | {"runs": len(results)}))
