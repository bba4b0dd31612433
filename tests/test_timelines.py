"""docs/timelines.py: the committed timelines show what a real 2-rank run does today.

The script runs once (2 gloo processes, about 10 to 25 s on 2 cores) into a temporary directory. Its
times change from run to run and are never compared; the structure of timelines.json (everything
outside the keys named "times") must equal the committed docs/images/timelines.json: which events
happen in which order on each rank, which collective follows which block, the buckets, the
all-gathers in backward. The other tests read the committed file (the first one ties it to what the
code does today) and check that the pictures show what their titles and the pages say.
"""

import json
import re
import sys

import pytest
import torch
from conftest import ROOT, Run, child_env
from test_figures import png_size

from models import BabyCNN

IMAGES = ROOT / "docs" / "images"
ACTION = re.compile(r"(\d+)([FBIW])(\d+)")  # torch's notation: 2F0 = stage 2, forward, microbatch 0
BLOCKS = 4


def differences(fresh, committed, path=""):
    """The paths at which two structures differ, with both values: what a failure shows."""
    if isinstance(fresh, dict) and isinstance(committed, dict):
        return [
            d
            for key in fresh.keys() | committed.keys()
            for d in differences(fresh.get(key), committed.get(key), f"{path}/{key}")
        ]
    if (
        isinstance(fresh, list)
        and isinstance(committed, list)
        and len(fresh) == len(committed)
        and any(isinstance(v, (dict, list)) for v in fresh)
    ):
        return [
            d
            for k, (a, b) in enumerate(zip(fresh, committed))
            for d in differences(a, b, f"{path}/{k}")
        ]
    return [] if fresh == committed else [f"{path}: now {fresh}, committed {committed}"]


def structure(value):
    """``value`` without its measurements: every key named "times" left out, at any depth."""
    if isinstance(value, dict):
        return {key: structure(v) for key, v in value.items() if key != "times"}
    if isinstance(value, list):
        return [structure(v) for v in value]
    return value


@pytest.fixture(scope="module")
def committed():
    return json.loads((IMAGES / "timelines.json").read_text())


@pytest.mark.slow  # the docs' runs, as their exercises (pytest.ini)
@pytest.mark.pages
def test_timelines_match_the_committed_ones(tmp_path, committed):
    run = Run(
        [sys.executable, ROOT / "docs" / "timelines.py", "--out", tmp_path], env=child_env()
    ).wait(timeout=240)
    if torch.__version__ < (
        2,
        14,
    ):  # zbv cannot run on gloo there: docs/timelines.py refuses in one line
        assert run.returncode == 1 and "zbv cannot run on gloo" in run.output, run.output
        return
    assert run.returncode == 0, f"docs/timelines.py failed:\n{run.output[-4000:]}"
    fresh = json.loads((tmp_path / "timelines.json").read_text())
    stale = differences(structure(fresh), structure(committed))
    assert not stale, (
        "docs/images/timelines.json is out of date: the code (or torch) now runs a step another "
        "way. "
        "Run `python docs/timelines.py`, look at the PNGs, update the numbers the pages read from "
        "them "
        "and commit docs/images/.\n" + "\n".join(stale)
    )
    for figure in fresh.values():
        for directory in (tmp_path, IMAGES):
            width, height = png_size(directory / figure["png"])
            assert 800 <= width <= 2000 and 400 <= height <= 1600, (figure["png"], width, height)
    print(f"docs/timelines.py took {run.seconds:.1f} s")


def test_ddp_buckets_and_overlap(committed):
    """Default buckets: one, all-reduced after the whole backward. bucket_cap_mb=0.05: three, in the
    reverse order of the parameters, the first all-reduced while the earlier blocks' backward still
    runs."""
    names = [name for name, _ in BabyCNN(device="meta").named_parameters()]
    runs = committed["ddp"]["runs"]
    assert [len(run["buckets"]) for run in runs.values()] == [1, 3]
    for label, run in runs.items():
        held = [name for bucket in run["buckets"] for name in bucket["parameters"]]
        assert sorted(held) == sorted(names), label  # every gradient in exactly one bucket
        assert sum(bucket["bytes"] for bucket in run["buckets"]) == 4 * 42_978, (
            label
        )  # fp32 gradients
        assert (
            run["buckets"][0]["parameters"][0] == "blocks.3.fc.bias"
        )  # backward's first gradients first
        for order in run["order"]:
            computed = [event for event in order if event.startswith(("forward", "backward"))]
            assert computed == [f"forward blocks.{i}" for i in range(BLOCKS)] + [
                f"backward blocks.{i}" for i in reversed(range(BLOCKS))
            ], label
            assert order[-1] == "optimizer step" and order[-2].startswith("all-reduce"), label
    assert runs["default"]["overlaps_backward"] == [False, False]
    assert runs["0.05"]["overlaps_backward"] == [True, True]
    # The cap rule docs/ddp.md states: a bucket closes with the gradient that takes it to the cap or
    # past it.
    sizes = {name: 4 * p.numel() for name, p in BabyCNN(device="meta").named_parameters()}
    cap = 0.05 * 2**20
    *closed, last = [bucket["parameters"] for bucket in runs["0.05"]["buckets"]]
    for held in closed:
        assert sum(sizes[name] for name in held[:-1]) < cap <= sum(sizes[name] for name in held), (
            held
        )
    assert (
        sum(sizes[name] for name in last[:-1]) < cap
    )  # the last one closes at backward's end, below the cap
    # As a bucket of at most the cap (the rule the page once stated) it would fail: the buckets
    # cross it.
    assert any(sum(sizes[name] for name in held) > cap for held in closed)
    for order in runs["0.05"][
        "order"
    ]:  # bucket 0 starts as soon as blocks.3's backward ends, before blocks.2's
        assert order.index("all-reduce bucket 0") == order.index("backward blocks.3") + 1
        assert order.index("all-reduce bucket 2") > order.index("backward blocks.0")


def test_fsdp_gathers_and_reduces_per_block(committed):
    """Each block's forward right after its all-gather; each block's reduce-scatter right after its
    backward; full gathers blocks 2, 1, 0 again during backward (each just before the block after it
    computes: a prefetch), grad-op never does, and holds their gathered weights instead."""
    fsdp = committed["fsdp"]
    for sharding, s in fsdp["shardings"].items():
        for order, collectives in zip(s["order"], s["collectives"]):
            for i in range(BLOCKS):
                forward, backward = (
                    order.index(f"forward blocks.{i}"),
                    order.index(f"backward blocks.{i}"),
                )
                assert order[forward - 1] == f"all-gather blocks.{i}", (sharding, order)
                assert order[backward + 1] == f"reduce-scatter blocks.{i}", (sharding, order)
            assert collectives["forward"] == [f"all-gather blocks.{i}" for i in range(BLOCKS)], (
                sharding
            )
            reduces = [c for c in collectives["backward"] if c.startswith("reduce-scatter")]
            assert reduces == [f"reduce-scatter blocks.{i}" for i in reversed(range(BLOCKS))], (
                sharding
            )
    full, grad_op = fsdp["shardings"]["full"], fsdp["shardings"]["grad-op"]
    assert full["all_gathers_in_backward"] == [["blocks.2", "blocks.1", "blocks.0"]] * 2
    assert grad_op["all_gathers_in_backward"] == [[], []]
    for order in full["order"]:  # block i - 1 is gathered before block i's backward begins
        for i in range(1, BLOCKS):
            gathered = max(
                k for k, event in enumerate(order) if event == f"all-gather blocks.{i - 1}"
            )
            assert gathered < order.index(f"backward blocks.{i}"), order
    # At the end of forward grad-op holds, on every rank, exactly the gathered weights of blocks 0
    # to 2 more than full (which resharded them; both keep the last block's for its backward), in
    # fp32.
    model = BabyCNN(width=fsdp["width"], device="meta")
    gathered = 4 * sum(p.numel() for block in model.blocks[:-1] for p in block.parameters())
    assert fsdp["grad_op_holds_more_after_forward_bytes"] == [gathered] * 2


def test_pipeline_schedules_run_in_their_order(committed):
    """The orders really differ the way the picture and the page say."""
    pipeline = committed["pipeline"]
    schedules, microbatches = pipeline["schedules"], pipeline["microbatches"]
    assert [a[1] for a in schedules["gpipe"]["ran"][0]] == ["F"] * microbatches + [
        "B"
    ] * microbatches
    first_1f1b = [a[1] for a in schedules["1f1b"]["ran"][0]]
    assert first_1f1b.index("B") < len(first_1f1b) - 1 - first_1f1b[::-1].index(
        "F"
    )  # a backward between forwards
    for name, s in schedules.items():
        for rank, ran in enumerate(s["ran"]):
            actions = [ACTION.fullmatch(a).groups() for a in ran]
            assert sorted({int(stage) for stage, _, _ in actions}) == s["stages"][rank], name
            for stage in s["stages"][
                rank
            ]:  # each microbatch once through each local stage, forward and backward
                done = sorted(kind + m for st, kind, m in actions if int(st) == stage)
                expected = [
                    sorted(k + str(m) for k in kinds for m in range(microbatches))
                    for kinds in ("FB", "FIW")
                ]
                assert done in expected, (name, stage, done)
    assert schedules["interleaved-1f1b"]["stages"] == [[0, 2], [1, 3]]  # loop placement
    assert schedules["zbv"]["stages"] == [[0, 3], [1, 2]]  # the V
    assert any(
        "W" in a for a in schedules["zbv"]["ran"][0]
    )  # zero bubble splits the backward in I and W
