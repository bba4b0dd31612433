"""--deterministic: bitwise-identical reruns of a command on a GPU, imported only with that flag.

On a CPU the scripts' kernels are deterministic already. On a GPU some sum in an order that changes
from run to run (atomic adds, cuBLAS's split reductions, cuDNN's algorithm chosen by timing), so
two runs of one command part after a few steps and no resume can be checked bitwise. What each
setting costs on a GPU is unmeasured (no GPU was lent to the change that added it).
"""

import os

import torch


def enable():
    """Deterministic kernels from here on; before the first matmul, which reads cuBLAS's setting."""
    # cuBLAS: a fixed workspace for each stream, else its reductions split by what is free
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # An op without a deterministic kernel warns, naming itself, rather than stop the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True  # convolutions: deterministic algorithms only
    torch.backends.cudnn.benchmark = False  # not the fastest by timing, which varies by run
