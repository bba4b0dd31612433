"""What a flight recorder holds when a rank stops calling collectives: each rank's last one.

Run:  TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc-per-node=2
docs/snippets/flight_recorder.py

Rank 1 never calls the fourth all-reduce, so rank 0 waits in it until the process group's timeout
(2 s here); then each rank prints the last entry of its flight recorder. TORCH_FR_BUFFER_SIZE: how
many collectives it keeps (torch 2.14 keeps 2,000 by default; 2.9 records nothing on gloo without
it).
"""

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json  # private: what a dump holds, as JSON

dist.init_process_group("gloo", timeout=timedelta(seconds=2))
rank = dist.get_rank()
tensor = torch.ones(1000)
for step in range(4):
    if rank == 1 and step == 3:
        time.sleep(3)  # stuck elsewhere: rank 1 never calls the fourth all-reduce
        break
    try:
        dist.all_reduce(tensor)  # collective
    except RuntimeError as error:
        print(f"rank {rank}: {str(error).splitlines()[0]}", flush=True)
dump = json.loads(_dump_fr_trace_json())
last = dump["entries"][-1]
keep = (
    "collective_seq_id",
    "profiling_name",
    "input_sizes",
    "input_dtypes",
    "process_group",
    "timeout_ms",
)
print(
    f"rank {rank}: {len(dump['entries'])} collectives recorded, the last:",
    json.dumps({k: last[k] for k in keep}),
)
dist.destroy_process_group()
