"""docs/figures.py: the committed pictures are the ones the code draws today.

The script runs once (4 gloo processes, a few seconds) into a temporary directory. Its figures.json,
the exact data each picture draws, must equal the committed docs/images/figures.json: PNG bytes
differ between matplotlib and freetype versions, the data does not. A few facts on that data check
that the pictures show what their titles say.
"""

import json
import math
import struct
import sys

import pytest
from conftest import ROOT, Run, child_env

IMAGES = ROOT / "docs" / "images"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from a PNG's header, after checking it is one."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path} is only {len(data)} bytes"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # the docs' runs, as their exercises (pytest.ini)
@pytest.mark.pages
def test_figures_match_the_committed_ones(tmp_path):
    # The same data on torch 2.9.1 and 2.14.1 (compared by hand): no release is left out.
    run = Run(
        [sys.executable, ROOT / "docs" / "figures.py", "--out", tmp_path], env=child_env()
    ).wait(timeout=180)
    assert run.returncode == 0, f"docs/figures.py failed:\n{run.output[-4000:]}"
    fresh = json.loads((tmp_path / "figures.json").read_text())
    committed = json.loads((IMAGES / "figures.json").read_text())
    stale = sorted(
        key for key in fresh.keys() | committed.keys() if fresh.get(key) != committed.get(key)
    )
    assert not stale, (
        f"docs/images/ is out of date for {stale}: the code (or torch) now draws other pictures. "
        "Run `python docs/figures.py`, look at the PNGs and commit docs/images/."
    )
    for figure in fresh.values():
        for directory in (tmp_path, IMAGES):
            width, height = png_size(directory / figure["png"])
            assert 800 <= width <= 2000 and 400 <= height <= 1600, (figure["png"], width, height)

    # DistributedSampler: every rank the same count, rank r at positions r, r+W, ... of the order
    # the ranks are dealt from: with drop_last=True the first W x floor(N / W) positions (disjoint
    # shares), with drop_last=False the whole order padded by its own first indices to W x ceil(N /
    # W) (the padding is seen twice).
    sampler = fresh["sampler"]
    n, order = sampler["samples"], sampler["order"]
    assert sorted(order) == list(range(n))
    assert {(p["world_size"], p["drop_last"]) for p in sampler["panels"]} >= {
        (4, True),
        (4, False),
    } and n % 4
    for p in sampler["panels"]:
        world, shares = p["world_size"], p["ranks"]
        per_rank = n // world if p["drop_last"] else -(-n // world)
        dealt = (
            order[: per_rank * world] if p["drop_last"] else order + order[: per_rank * world - n]
        )
        assert [len(share) for share in shares] == [per_rank] * world
        assert all(shares[r] == dealt[r::world] for r in range(world))
        if p["drop_last"]:
            assert (
                len(set().union(*map(set, shares))) == per_rank * world
                and p["dropped"] == order[per_rank * world :]
            )
        else:
            assert (
                p["repeated"] == order[: per_rank * world - n]
                and len(p["repeated"]) == world - n % world
            )
            assert sorted(sum(shares, [])) == sorted(
                order + p["repeated"]
            )  # every sample once, the padding twice

    # FSDP: each rank holds one block of rows, at most ceil(rows / W); the shards cover every row
    # once per replica.
    fsdp = fresh["fsdp_shards"]
    world = fsdp["world_size"]
    for label, shards in (("full", world), ("hybrid", world // 2)):
        for name, p in fsdp["layouts"][label]["parameters"].items():
            n = p["shape"][0]
            blocks = sorted({tuple(rows) for rows in p["rows"] if rows})
            assert all(stop - start <= math.ceil(n / shards) for start, stop in blocks), (
                label,
                name,
            )
            assert [start for start, _ in blocks] == [0] + [stop for _, stop in blocks[:-1]], (
                label,
                name,
            )
            assert blocks[-1][1] == n and len(blocks) <= shards, (label, name)
    hybrid = fsdp["layouts"]["hybrid"]["parameters"].values()
    assert all(
        p["rows"][r] == p["rows"][r + world // 2] for p in hybrid for r in range(world // 2)
    )  # replicas

    # Ring all-reduce: every rank ends with the sum, as the real dist.all_reduce did.
    ring = fresh["ring_allreduce"]
    total = [sum(column) for column in zip(*ring["inputs"])]
    assert ring["result"] == ring["all_reduce"] == [total] * ring["world_size"]
    gathered = ring["steps"][ring["world_size"] - 1][
        "before"
    ]  # before the all-gather: each rank owns one sum
    assert all(sum(len(held) == ring["world_size"] for held in rank) == 1 for rank in gathered)
    # The share each rank sends, counted by the simulation: 2(W-1) chunks of 1/W, in 2(W-1) steps.
    world = ring["world_size"]
    assert len(ring["steps"]) == 2 * (world - 1)
    assert all(
        sum(s["src"] == rank for step in ring["steps"] for s in step["sends"]) == 2 * (world - 1)
        for rank in range(world)
    )
    assert all(
        numerator * world == 2 * (world - 1) * denominator
        for numerator, denominator in ring["sent_share"]
    )

    # Tensor parallelism: train_tp.py's pair, column-wise (output channels, Shard(0)) then row-wise
    # (input channels, Shard(1), the bias whole): each rank holds 1/tp of each weight, and conv1's
    # channels are what conv2 takes in.
    tp = fresh["tp_pair"]
    conv1, conv2 = tp["layers"]["conv1"], tp["layers"]["conv2"]
    placements = (conv1["weight_placement"], conv2["weight_placement"], conv2["bias_placement"])
    assert placements == ("S(0)", "S(1)", "R")
    assert conv1["weight_local"][0] * tp["tp"] == conv1["weight"][0]
    assert conv1["bias_local"][0] * tp["tp"] == conv1["bias"][0]
    assert conv2["weight_local"][1] * tp["tp"] == conv2["weight"][1]
    assert conv2["bias_local"] == conv2["bias"]
    assert conv1["output"][1] == conv1["weight_local"][0] == conv2["input"][1]
    assert conv2["input"][1] == conv2["weight_local"][1]
    # whole in, whole out
    assert conv1["input"][1] == conv1["weight"][1] and conv2["output"][1] == conv2["weight"][0]

    # Overlap, a model: each collective lasts α + n·β of its fit; a lane runs one thing at a time;
    # compute keeps its order and its measured durations; overlapping never makes the step longer,
    # and taking turns never runs a collective beside compute.
    overlap = fresh["overlap"]
    assert overlap["model"] is True
    for panel in overlap["panels"].values():
        turns, overlapped = (panel["runs"][mode] for mode in ("taking turns", "overlapped"))
        assert [a["label"] for a in turns] == [a["label"] for a in overlapped]
        for laid in (turns, overlapped):
            for lane in ("compute", "comm"):
                spans = [(a["start"], a["end"]) for a in laid if a["lane"] == lane]
                pairs = zip(spans, spans[1:])
                assert all(end <= start + 1e-6 for (_, end), (start, _) in pairs), spans
            for action in laid:
                if action["lane"] == "comm":
                    kind = (
                        "all_reduce"
                        if "all-reduce" in action["label"]
                        else ("all_gather" if "all-gather" in action["label"] else "reduce_scatter")
                    )
                    alpha, beta = panel["fit_ms"][kind]
                    expected = alpha + panel["bytes"][action["label"]] * beta
                    took = action["end"] - action["start"]
                    assert math.isclose(took, expected, abs_tol=2e-3), action
        spans = sorted((a["start"], a["end"]) for a in turns)
        pairs = zip(spans, spans[1:])  # one thing at a time
        assert all(end <= start + 1e-6 for (_, end), (start, _) in pairs)
        assert panel["step_ms"]["overlapped"] <= panel["step_ms"]["taking turns"]
        compute = [
            [a["end"] - a["start"] for a in laid if a["lane"] == "compute"]
            for laid in (turns, overlapped)
        ]
        assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(*compute))
    print(f"docs/figures.py took {run.seconds:.1f} s")
