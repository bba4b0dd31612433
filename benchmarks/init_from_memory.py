"""What --init-from holds in each rank's memory: the resident set of each rank before and after
init_from.load (rank 0 reads the file, the others receive each weight by broadcast), beside
every rank reading the file itself: the highest resident set while the weights load, over the one
before. BabyCNN at --width 16 (7.2 M parameters, a 29 MB file). Prints a JSON line.

    python benchmarks/init_from_memory.py               # 2 CPU processes
    python benchmarks/init_from_memory.py --width 24 --ranks 4
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resident_bytes():  # the resident set now (not its peak): /proc/self/statm counts pages
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(path, width, out, way):  # one way a launch: memory the other freed would be reused
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from models import BabyCNN
    from plumbing import init_from

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = BabyCNN(width=int(width))
    dist.barrier()
    before, peak, done = resident_bytes(), [0], threading.Event()

    def watch():  # the highest resident set while the weights load: sampled every millisecond
        while not done.wait(0.001):
            peak[0] = max(peak[0], resident_bytes())

    watcher = threading.Thread(target=watch)
    watcher.start()
    if way == "broadcast from rank 0":
        init_from.load(model, path, print)
    else:
        model.load_state_dict(torch.load(path, weights_only=True))
    done.set()
    watcher.join()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, max(peak[0], resident_bytes()) - before)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main():
    if sys.argv[1:2] == ["--worker"]:
        return worker(*sys.argv[2:6])
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from models import BabyCNN

    with tempfile.TemporaryDirectory() as directory:
        path, out = Path(directory) / "weights.pt", Path(directory) / "out.json"
        torch.manual_seed(1)
        torch.save(BabyCNN(width=args.width).state_dict(), path)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        added = {}
        for way in ("broadcast from rank 0", "every rank reads the file"):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={args.ranks}",
                    __file__,
                    "--worker",
                    str(path),
                    str(args.width),
                    str(out),
                    way,
                ],
                env=env,
                check=True,
                capture_output=True,
            )
            added[way] = json.loads(out.read_text())
        print(
            json.dumps(
                {
                    "width": args.width,
                    "file_bytes": path.stat().st_size,
                    "ranks": args.ranks,
                    "resident_bytes_added": added,
                }
            )
        )


if __name__ == "__main__":
    main()
