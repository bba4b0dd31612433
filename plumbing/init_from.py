"""--init-from FILE: start from a file's weights with a fresh optimizer (opt-in: imported only
when the flag is given, so a copy without this file refuses the flag in one line)."""

import torch
import torch.distributed as dist

from plumbing.failures import UsageError, input_error, on_rank_0


def load(model, path, log):
    """Collective: ``path``'s weights (torch.save's or .safetensors) into ``model``, unwrapped
    and uncut; rank 0 reads, checks and broadcasts them: a node holds them once."""
    expected = model.state_dict()

    def read():  # on rank 0
        try:
            with open(path, "rb"):  # the OS's own word: missing, a permission, a directory
                pass
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file  # optional

                weights = load_file(path)
            else:  # weights_only: no pickled code runs
                weights = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except OSError as error:  # an I/O error is one, not a file of something else
            error.filename = path if error.filename is None else error.filename  # a read's
            raise input_error(error, "--init-from") from None
        except ImportError:
            why = "reading .safetensors needs pip install safetensors"
            raise UsageError(f"--init-from {path}: {why}") from None
        except Exception as error:  # the errors vary
            why = " ".join(str(error).split())[:200]
            raise UsageError(f"--init-from {path} is not a file of weights ({why})") from None
        if not isinstance(weights, dict) or not all(map(torch.is_tensor, weights.values())):
            raise UsageError(f"--init-from {path} holds no state dict of tensors")
        misfit = f"--init-from {path} does not fit this model"
        for name, tensor in expected.items():
            if name not in weights:
                raise UsageError(f"{misfit}: it has no {name}")
            if weights[name].shape != tensor.shape:
                there, here = list(weights[name].shape), list(tensor.shape)
                raise UsageError(f"{misfit}: {name} is {there} there, {here} here")
        if extra := sorted(set(weights) - set(expected)):
            raise UsageError(f"{misfit}: it has {extra[0]}, which this model lacks")
        return weights

    weights = on_rank_0(read, f"reading --init-from {path}", share=False)  # None elsewhere
    with torch.no_grad():
        for name, tensor in expected.items():
            if weights is not None:
                tensor.copy_(weights[name])
            dist.broadcast(tensor, src=0)
    log(f"initialised the model from {path}; the optimizer and the lr schedule start afresh")
