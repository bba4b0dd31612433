"""The bytes a rank sends per step, as the pages quote them, held to a fresh count of the scripts'
own collectives (benchmarks/bytes_per_step.py: each script under torchrun, 2 gloo processes, one
traced step). Byte counts do not vary from run to run, so every comparison is exact.

Marked slow and pages: eight launches, about a minute and a half on 2 cores."""

import re

import pytest
from conftest import ROOT

from benchmarks import bytes_per_step

DOCS = ROOT / "docs"
STREAM = 64 * 128 * 4  # the GPT's residual stream, one sequence: 64 positions x 128 floats


def sentence(page, pattern):
    """The groups of ``pattern`` in ``page``, its line breaks read as spaces: a test that fails
    here means the page's sentence changed, not the figures."""
    text = " ".join((DOCS / page).read_text().split())
    match = re.search(pattern, text)
    assert match, f"docs/{page}: nothing matches {pattern!r}"
    return [int(g.replace(",", "")) if re.fullmatch(r"[\d,]+", g) else g for g in match.groups()]


@pytest.fixture(scope="module")
def counted():
    """{(model, strategy, batch): the benchmark's result}: the defaults, and the GPT's TP at
    batches 4 and 8."""
    runs = [(m, s, None) for m in bytes_per_step.MODELS for s in bytes_per_step.SCRIPTS]
    runs += [("gpt", "tp", 4), ("gpt", "tp", 8)]
    return {
        run: bytes_per_step.count(run[0], run[1], batch_size=run[2], log=lambda line: None)
        for run in runs
    }


def sent(counted, model, strategy, batch=None):
    return counted[(model, strategy, batch)]["sent_per_rank"]


@pytest.mark.slow
@pytest.mark.pages
def test_the_pages_bytes_per_step_are_the_benchmarks(counted):
    # the collectives page's formulas are the ones the benchmark applies
    text = " ".join((DOCS / "collectives.md").read_text().split())
    assert "`(W − 1)/W · n` for an all-gather or a reduce-scatter" in text
    assert "`2(W − 1)/W · n` for an all-reduce" in text
    assert "`(W − 1)/W · n` on average for a broadcast" in text
    assert bytes_per_step.RING == {
        "all_gather": 1,
        "reduce_scatter": 1,
        "broadcast": 1,
        "all_reduce": 2,
    }

    # FSDP's page: both models, FSDP against DDP, and the share of the last unit
    cnn_fsdp, cnn_ddp, share, gpt_fsdp, gpt_ddp = sentence(
        "fsdp.md",
        r"BabyCNN sends ([\d,]+) bytes a rank, DDP ([\d,]+) \(its last unit, (\d+%), is gathered "
        r"once\); the GPT ([\d,]+), DDP ([\d,]+)\.",
    )
    assert cnn_fsdp == sent(counted, "cnn", "fsdp")
    assert cnn_ddp == sent(counted, "cnn", "ddp")
    assert f"the largest {share} of the parameters" in counted[("cnn", "fsdp", None)]["start_line"]
    assert gpt_fsdp == sent(counted, "gpt", "fsdp")
    assert gpt_ddp == sent(counted, "gpt", "ddp")
    assert gpt_fsdp < 1.5 * gpt_ddp < 1.01 * gpt_fsdp  # "up to 1.5× DDP's all-reduce"

    # the TP page: BabyCNN's TP
    cnn_tp, times, ddp = sentence(
        "parallelism.md",
        r"On 2 ranks at batch 64 a rank sends ([\d,]+) bytes a step, (\d+)× DDP's ([\d,]+)",
    )
    assert cnn_tp == sent(counted, "cnn", "tp")
    assert ddp == sent(counted, "cnn", "ddp")
    assert times == round(cnn_tp / ddp)

    # the transformer page: the GPT under each, the stream's share of TP's, and batch 4
    gpt_ddp, gpt_fsdp, gpt_tp, stream_mb = sentence(
        "transformer.md",
        r"a rank sends ([\d,]+) under \[DDP\]\(glossary.md#ddp\), ([\d,]+) under FSDP and "
        r"([\d,]+) under TP, ([\d.]+) MB of it half of each of the 36 large collectives' "
        r"16 × 64 × 128 floats",
    )
    assert (gpt_ddp, gpt_fsdp, gpt_tp) == tuple(
        sent(counted, "gpt", s) for s in ("ddp", "fsdp", "tp")
    )
    tp = counted[("gpt", "tp", None)]["step"]
    stream = 36 * 16 * STREAM // 2
    # the rest of the all-gathers and reduce-scatters: the position embedding's, one sequence's
    assert tp["all_gather"]["sent"] + tp["reduce_scatter"]["sent"] - stream == 2 * STREAM // 2
    assert stream_mb == f"{stream / 1e6:.2f}"
    (at_4,) = sentence(
        "transformer.md", r"at `--batch-size 4` \(256 tokens\) TP sends ([\d,]+), below both"
    )
    assert at_4 == sent(counted, "gpt", "tp", 4) < gpt_ddp < gpt_fsdp

    # the negative control: a count at another batch is another figure, so the comparisons above
    # can fail; DDP's and FSDP's do not depend on the batch, TP's do
    assert sent(counted, "gpt", "tp", 4) != gpt_tp
    assert sent(counted, "gpt", "tp", 8) != gpt_tp


@pytest.mark.slow
@pytest.mark.pages
def test_the_measurements_page_has_the_benchmarks_table_and_the_rule_holds(counted):
    defaults = [
        counted[(m, s, None)] for m in bytes_per_step.MODELS for s in bytes_per_step.SCRIPTS
    ]
    page = (DOCS / "measurements.md").read_text()
    assert bytes_per_step.table(defaults) in page
    # the bookkeeping after the step: the stop agreement (2 int64s) and the loss (1 float)
    for result in defaults:
        assert result["after_step"] == {
            "all_reduce": {"calls": 2, "n": 20, "sent": 20, "gloo": "all_reduce"}
        }
    # TP at batch B: 590,592·B + 37,376 bytes, as the page derives it, at 4, 8 and 16
    slope, constant = sentence("measurements.md", r"TP sends ([\d,]+)·B \+ ([\d,]+) bytes")
    for batch in (4, 8, 16):
        assert (
            sent(counted, "gpt", "tp", None if batch == 16 else batch) == slope * batch + constant
        )
    at_8, fsdp = sentence(
        "measurements.md", r"`--batch-size 8` ([\d,]+) \(above DDP's, below FSDP's ([\d,]+)\)"
    )
    assert at_8 == sent(counted, "gpt", "tp", 8) and fsdp == sent(counted, "gpt", "fsdp")
    assert sent(counted, "gpt", "ddp") < at_8 < fsdp
