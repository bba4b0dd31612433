"""docs/figures.py: the committed pictures are the ones the code draws today.

The script runs once (4 gloo processes, a few seconds) into a temporary directory. Its figures.json, the exact
data each picture draws, must equal the committed docs/images/figures.json: PNG bytes differ between
matplotlib and freetype versions, the data does not. A few facts on that data check that the pictures show
what their titles say.
"""

import json
import math
import re
import struct
import sys

import torch

from conftest import ROOT, Run, child_env

IMAGES = ROOT / "docs" / "images"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ACTION = re.compile(r"(\d+)([FBIW])(\d+)")  # torch's notation: 2F0 = stage 2, forward, microbatch 0


def png_size(path):
    """(width, height) from a PNG's header, after checking it is one."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path} is only {len(data)} bytes"
    return struct.unpack(">II", data[16:24])


def test_figures_match_the_committed_ones(tmp_path):
    run = Run([sys.executable, ROOT / "docs" / "figures.py", "--out", tmp_path], env=child_env()).wait(timeout=180)
    if torch.__version__ < (2, 14):  # zbv cannot run on gloo there: docs/figures.py refuses in one line
        assert run.returncode == 1 and "zbv cannot run on gloo" in run.output, run.output
        return
    assert run.returncode == 0, f"docs/figures.py failed:\n{run.output[-4000:]}"
    fresh = json.loads((tmp_path / "figures.json").read_text())
    committed = json.loads((IMAGES / "figures.json").read_text())
    stale = sorted(key for key in fresh.keys() | committed.keys() if fresh.get(key) != committed.get(key))
    assert not stale, (f"docs/images/ is out of date for {stale}: the code (or torch) now draws other pictures. "
                       "Run `python docs/figures.py`, look at the PNGs and commit docs/images/.")
    for figure in fresh.values():
        for directory in (tmp_path, IMAGES):
            width, height = png_size(directory / figure["png"])
            assert 800 <= width <= 2000 and 400 <= height <= 1600, (figure["png"], width, height)

    # Pipeline schedules: the orders really differ the way the picture claims.
    schedules = fresh["pipeline_schedules"]["schedules"]
    microbatches = fresh["pipeline_schedules"]["microbatches"]
    assert [a[1] for a in schedules["gpipe"]["ran"][0]] == ["F"] * microbatches + ["B"] * microbatches
    first_1f1b = [a[1] for a in schedules["1f1b"]["ran"][0]]
    assert first_1f1b.index("B") < len(first_1f1b) - 1 - first_1f1b[::-1].index("F")  # a backward between forwards
    for name, s in schedules.items():
        for rank, (ran, slots) in enumerate(zip(s["ran"], s["timeline"])):
            assert [a for a in slots if a is not None] == ran, name  # the clock keeps each rank's order
            actions = [ACTION.fullmatch(a).groups() for a in ran]
            for stage in s["stages"][rank]:  # each microbatch once through each local stage, forward and backward
                done = sorted(kind + m for st, kind, m in actions if int(st) == stage)
                expected = [sorted(k + str(m) for k in kinds for m in range(microbatches)) for kinds in ("FB", "FIW")]
                assert done in expected, (name, stage, done)
    assert schedules["interleaved-1f1b"]["stages"] == [[0, 2], [1, 3]]  # loop placement
    assert schedules["zbv"]["stages"] == [[0, 3], [1, 2]]  # the V
    assert any("W" in a for a in schedules["zbv"]["ran"][0])  # zero bubble splits the backward in I and W

    # DistributedSampler: disjoint shares, rank r at positions r, r+W, ... of the first W x floor(N / W).
    sampler = fresh["sampler"]
    for world, w in sampler["worlds"].items():
        world, kept = int(world), sampler["samples"] // int(world) * int(world)
        shares = [set(share) for share in w["ranks"]]
        assert sum(map(len, shares)) == len(set().union(*shares)) == kept
        assert set().union(*shares) == set(sampler["order"][:kept])
        assert all(w["ranks"][r] == sampler["order"][r:kept:world] for r in range(world))

    # FSDP: each rank holds one block of rows, at most ceil(rows / W); the shards cover every row once per replica.
    fsdp = fresh["fsdp_shards"]
    world = fsdp["world_size"]
    for label, shards in (("full", world), ("hybrid", world // 2)):
        for name, p in fsdp["layouts"][label]["parameters"].items():
            n = p["shape"][0]
            blocks = sorted({tuple(rows) for rows in p["rows"] if rows})
            assert all(stop - start <= math.ceil(n / shards) for start, stop in blocks), (label, name)
            assert [start for start, _ in blocks] == [0] + [stop for _, stop in blocks[:-1]], (label, name)
            assert blocks[-1][1] == n and len(blocks) <= shards, (label, name)
    hybrid = fsdp["layouts"]["hybrid"]["parameters"].values()
    assert all(p["rows"][r] == p["rows"][r + world // 2] for p in hybrid for r in range(world // 2))  # replicas

    # Ring all-reduce: every rank ends with the sum, as the real dist.all_reduce did.
    ring = fresh["ring_allreduce"]
    total = [sum(column) for column in zip(*ring["inputs"])]
    assert ring["result"] == ring["all_reduce"] == [total] * ring["world_size"]
    gathered = ring["steps"][ring["world_size"] - 1]["before"]  # before the all-gather: each rank owns one sum
    assert all(sum(len(held) == ring["world_size"] for held in rank) == 1 for rank in gathered)
    print(f"docs/figures.py took {run.seconds:.1f} s")
