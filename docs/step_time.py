"""A step's time, predicted: compute, plus the communication that overlap does not hide.

    python docs/step_time.py     # reads the committed results: instant

    step ≈ compute + unhidden communication
    compute = FLOPs a token x tokens a GPU / (peak FLOP/s x utilisation)
    a collective = α + n·β  (the α–β model, docs/collectives.md)

Two cases, each from the project's own figures:

- here: the GPT's collectives on 2 gloo processes (docs/results/bytes_per_step.json: the
  calls and bytes n of each kind), timed with the α–β fits benchmarks/collectives.py measured on
  this machine (benchmarks/results/collectives.json). On a CPU nothing overlaps.
- at scale: Llama-3-8B (docs/activation_memory.py's shapes) on 8 GPUs, 2 sequences of 4,096
  tokens a GPU, its bytes from the strategies' formulas (docs/transformer.md's table) and the
  links' bandwidths below. A ring moves (W - 1)/W of n per rank at the link's speed each way.
  FSDP's and the pipeline's transfers overlap compute; TP's wait on every layer. The pipeline
  also idles its bubble, (p - 1)/(m + p - 1).

The hardware figures, with their sources:
- H100 SXM: 989 TFLOP/s dense bf16; NVLink 900 GB/s a GPU, 450 each way (NVIDIA H100 Tensor Core
  GPU datasheet).
- InfiniBand NDR: 400 Gb/s a port, 50 GB/s each way; a DGX H100 has one port a GPU (NVIDIA DGX
  H100 user guide).
- utilisation 40%: Llama 3's training reached 38-43% of bf16 peak on H100s (arXiv:2407.21783,
  table 4).
- FLOPs a token: 6·P + 12·L·T·C, forward and backward with attention (PaLM, arXiv:2204.02311,
  appendix B).

Prints a summary; writes JSON to --out (default docs/results/step_time.json).
"""

import argparse
import json
from pathlib import Path

from activation_memory import LLAMA_8B, llama_params

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
OUT = RESULTS / "step_time.json"
H100_FLOPS, UTILISATION = 989e12, 0.40
NVLINK, INFINIBAND = 450e9, 50e9  # bytes a second, each way, a GPU


def gloo_case():
    """Seconds of communication a step for the GPT's strategies on 2 gloo processes."""
    counted = json.loads((RESULTS / "bytes_per_step.json").read_text())
    fits = json.loads((ROOT / "benchmarks" / "results" / "collectives.json").read_text())
    fit = next(r for r in fits["results"] if r["world_size"] == 2)["collectives"]
    case = {}
    for result in counted:
        if result["model"] != "gpt":
            continue
        seconds = sum(
            row["calls"] * fit[kind]["alpha_s"] + row["n"] * fit[kind]["beta_s_per_byte"]
            for kind, row in result["step"].items()
        )
        calls = sum(row["calls"] for row in result["step"].values())
        case[result["strategy"]] = {"calls": calls, "n": result["n"], "seconds": seconds}
    return case


def scale_case(gpus=8, sequences=2, sequence=4096):
    """Llama-3-8B on 8 GPUs, 2 sequences of 4k a GPU: compute and bytes a step, per layout."""
    m = LLAMA_8B
    params = llama_params()
    C, L = m["C"], m["layers"]
    tokens = sequences * sequence * gpus  # a step, all GPUs
    flops_token = 6 * params + 12 * L * sequence * C
    compute = flops_token * tokens / gpus / (H100_FLOPS * UTILISATION)  # each GPU's share
    ring = (gpus - 1) / gpus
    fsdp = ring * (2 + 2 + 4) * params  # bf16 weights gathered twice, fp32 gradients scattered
    tp = ring * 8 * L * tokens * C * 2  # the stream, 8 transfers a block, bf16: all the tokens
    # a pipeline of 8 stages sends each boundary's stream forward and its gradient back
    pipeline = 2 * tokens * C * 2
    layouts = {
        "FSDP in a node (NVLink)": (fsdp, NVLINK, True),
        "FSDP across nodes (InfiniBand)": (fsdp, INFINIBAND, True),
        "TP + SP in a node (NVLink)": (tp, NVLINK, False),
        "pipeline across nodes (InfiniBand)": (pipeline, INFINIBAND, True),
    }
    # the pipeline's bubble: microbatches of 2 sequences (what fits), m of them, p = 8 stages
    m = tokens // (2 * sequence)
    bubble = (gpus - 1) / (m + gpus - 1)
    rows = {}
    for name, (sent, link, overlaps) in layouts.items():
        comm = sent / link
        unhidden = max(0.0, comm - compute) if overlaps else comm
        busy = compute / (1 - bubble) if name.startswith("pipeline") else compute
        rows[name] = {"bytes": sent, "comm": comm, "step": busy + unhidden}
    return {
        "params": params,
        "tokens": tokens,
        "flops_token": flops_token,
        "compute": compute,
        "microbatches": m,
        "bubble": bubble,
        "layouts": rows,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    results = {"gloo": gloo_case(), "scale": scale_case()}
    for strategy, row in results["gloo"].items():
        print(
            f"GPT {strategy} on 2 gloo ranks: {row['calls']} calls, {row['n']:,} bytes n: "
            f"{row['seconds'] * 1e3:.1f} ms"
        )
    scale = results["scale"]
    print(f"Llama-3-8B, 8 GPUs, compute a step: {scale['compute']:.2f} s")
    for name, row in scale["layouts"].items():
        print(
            f"  {name}: {row['bytes'] / 1e9:.1f} GB a GPU, {row['comm']:.3f} s; "
            f"step {row['step']:.2f} s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
