"""The snippets in docs/snippets/ do what the pages say (that the pages quote them as they are:
test_docs.py).

Each snippet runs under torchrun on 2 gloo processes, and its output is checked against what torch
itself computes: the DataLoader's shards against a DistributedSampler, join()'s final weights
against the same steps worked out in one process, GradScaler's skipped steps against its documented
rule.
"""

import importlib.util
import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, succeeded, torchrun
from torch.utils.data.distributed import DistributedSampler

pytestmark = [
    pytest.mark.slow,
    pytest.mark.pages,
]  # the docs' code, as their exercises (pytest.ini)


def json_lines(output):
    return [json.loads(line) for line in output.splitlines() if line.startswith(("{", "[{"))]


@pytest.fixture(scope="module", autouse=True)
def no_join():
    """join.py --no-join, started first: it spends most of its time waiting for its 10 s timeout,
    while the other tests run; the last test reads how it ended."""
    run = torchrun("docs/snippets/join.py", 2, "--no-join")
    yield run
    run.kill()


def test_the_dataloader_snippet_deals_disjoint_shards_that_cover_each_epoch():
    epochs = json_lines(succeeded(torchrun("docs/snippets/dataloader.py", 2)).output)
    assert [entry["epoch"] for entry in epochs] == [0, 1]
    for entry in epochs:
        ranks = entry["indices"]
        for rank, indices in enumerate(
            ranks
        ):  # what a DistributedSampler alone deals this rank, in order
            sampler = DistributedSampler(
                range(1001), num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True
            )
            sampler.set_epoch(entry["epoch"])
            assert indices == list(sampler)
        assert len(ranks[0]) == len(ranks[1]) == 500 and not set(ranks[0]) & set(ranks[1])
        assert len(set(ranks[0]) | set(ranks[1])) == 1000 and set(ranks[0]) | set(ranks[1]) <= set(
            range(1001)
        )
    assert epochs[0]["indices"][0] != epochs[1]["indices"][0]  # set_epoch: another shuffle
    # The sample drop_last leaves out of each epoch, as docs/batch.md says
    assert [set(range(1001)) - set(sum(entry["indices"], [])) for entry in epochs] == [{950}, {971}]


def _snippet(name):
    spec = importlib.util.spec_from_file_location(
        f"snippet_{name}", ROOT / "docs" / "snippets" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _join_by_hand(join, divisor):
    """join.py's steps in one process: each step's gradient is the sum over the ranks that still
    have a batch, divided by divisor(number of such ranks)."""
    model = join.make_model()
    data = [join.batches(rank) for rank in range(2)]
    for step in range(max(map(len, data))):
        active = [rank for rank in range(2) if step < len(data[rank])]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in active:
            model.zero_grad()
            inputs, targets = data[rank][step]
            F.mse_loss(model(inputs), targets).backward()
            total = [t + p.grad for t, p in zip(total, model.parameters())]
        with torch.no_grad():
            for p, t in zip(model.parameters(), total):
                p -= join.LR * t / divisor(len(active))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_join_lets_uneven_ranks_finish_and_averages_over_the_initial_world_size():
    ranks = json_lines(succeeded(torchrun("docs/snippets/join.py", 2)).output)[0]
    assert [entry["steps"] for entry in ranks] == [3, 4]
    weights = [torch.tensor(entry["weights"], dtype=torch.float64) for entry in ranks]
    assert torch.equal(
        weights[0], weights[1]
    )  # join() ends with the last rank's weights everywhere
    join = _snippet("join")
    expected = _join_by_hand(
        join, lambda active: 2
    )  # divide_by_initial_world_size=True, the default
    control = _join_by_hand(
        join, lambda active: active
    )  # dividing by the ranks still training instead
    assert (control - expected).abs().max() > 1e-2
    assert (weights[0] - expected).abs().max() < 1e-12


def test_grad_scaler_skips_overflowing_steps_and_halves_the_scale_on_every_rank():
    ranks = json_lines(succeeded(torchrun("docs/snippets/grad_scaler.py", 2)).output)
    assert [entry["rank"] for entry in ranks] == [0, 1]
    records = ranks[0]["records"]
    for record in records:
        if record["stepped"]:  # a step taken: the scale stays (growth_interval is far off)
            assert record["next_scale"] == record["scale"], record
        else:  # inf or NaN in a gradient: optimizer.step() skipped, the scale halved
            assert record["next_scale"] == record["scale"] / 2, record
    assert (
        records[0]["scale"] == 2.0**24 and not records[0]["stepped"]
    )  # 2**24 overflows float16 at once
    assert records[-1]["stepped"]
    # DDP all-reduced the scaled gradients, so an overflow anywhere was one everywhere: the ranks
    # agree.
    assert [(r["scale"], r["stepped"]) for r in ranks[1]["records"]] == [
        (r["scale"], r["stepped"]) for r in records
    ]
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_without_join_the_uneven_ranks_wait_until_the_timeout(no_join):
    """Rank 1's fourth all-reduce has no partner, rank 0 waits in the collective after its loop:
    both wait until the 10 s timeout. The first to time out fails; torchrun then stops the other,
    which may not get to say it."""
    no_join.wait()
    assert no_join.returncode != 0, no_join.output[-3000:]
    # gloo's words: "Timed out waiting 10000ms for recv operation to complete" (or send)
    assert any(
        re.match(r"\[rank[01]\]: RuntimeError: .*Timed out waiting 10000ms", line)
        for line in no_join.output.splitlines()
    ), no_join.output[-3000:]
    assert not json_lines(no_join.output)
