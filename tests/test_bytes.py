"""The bytes a rank sends per step, as the pages quote them, held to a fresh count of the scripts'
own collectives (docs/bytes_per_step.py: each script under torchrun, 2 gloo processes, one
traced step). Byte counts do not vary from run to run, so every comparison is exact.

Marked slow and pages: eight launches, about a minute and a half on 2 cores."""

import re

import pytest
from conftest import ROOT

from docs import bytes_per_step

DOCS = ROOT / "docs"
STREAM = 64 * 128 * 4  # the GPT's residual stream, one sequence: 64 positions x 128 floats


def sentence(page, pattern):
    """The groups of ``pattern`` in ``page``, its line breaks read as spaces: a test that fails
    here means the page's sentence changed, not the figures."""
    text = " ".join((DOCS / page).read_text().split())
    match = re.search(pattern, text)
    assert match, f"docs/{page}: nothing matches {pattern!r}"
    return [int(g.replace(",", "")) if re.fullmatch(r"[\d,]+", g) else g for g in match.groups()]


def model_sizes():
    """The GPT's sizes, read from the model the scripts build: parameters, those FSDP gathers once
    (train_fsdp.py's last unit) and the norms', blocks, width, positions; the scripts' batch and
    the benchmark's ranks."""
    from torch import nn

    from models.gpt import GPT
    from plumbing.parts import shard_units

    model = GPT()
    count = lambda params: sum(p.numel() for p in params)  # noqa: E731
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    # gathered once: what no unit but the last holds (the last unit's, and the root's, if any)
    units, _ = shard_units(model)
    earlier = {p for parent, name in units[:-1] for p in getattr(parent, name).parameters()}
    return {
        "P": count(model.parameters()),
        "P_last": count(p for p in model.parameters() if p not in earlier),
        "P_norm": count(p for m in norms for p in m.parameters()),
        "L": len(model.blocks) - 2,
        "C": model.blocks[0].tokens.embedding_dim,
        "T": model.blocks[0].positions.num_embeddings,
        "B": 16,
        "W": 2,
    }


def table_row(first):
    """The last cell of the transformer page's bytes table row whose first cell is ``first``."""
    for line in (DOCS / "transformer.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first and re.fullmatch(r"[\d,]+", cells[-1]):
            return int(cells[-1].replace(",", ""))
    raise AssertionError(f"docs/transformer.md: no bytes row {first!r}")


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

    # the transformer page's table: each term from the model's sizes, each total the count's
    gpt_ddp, gpt_fsdp, gpt_tp = (sent(counted, "gpt", s) for s in ("ddp", "fsdp", "tp"))
    sizes = model_sizes()
    P, L, C, T, B, W = (sizes[k] for k in ("P", "L", "C", "T", "B", "W"))
    assert sentence(
        "transformer.md",
        r"`P` = ([\d,]+) parameters, `L` = (\d+) blocks, width "
        r"`C` = (\d+), `T` = (\d+) positions, batch `B` = (\d+)",
    ) == [P, L, C, T, B]
    p_last, p_norm = sentence(
        "transformer.md",
        r"`P_last` = ([\d,]+), the root's: the two embeddings \(the head's table is the token "
        r"table\) and the head's norm; `P_norm` = ([\d,]+)",
    )
    assert (p_last, p_norm) == (sizes["P_last"], sizes["P_norm"])
    ring = (W - 1) / W
    stream = (8 * L + 4) * ring * 4 * B * T * C
    rest = 2 * ring * 4 * T * C + 2 * ring * 4 * (p_norm + 3 * B * T)
    assert table_row("DDP") == gpt_ddp == 2 * ring * 4 * P
    padding = table_row("FSDP") - ring * 4 * (3 * P - p_last)
    assert table_row("FSDP") == gpt_fsdp and 0 < padding < 0.001 * gpt_fsdp
    assert table_row("TP + SP") == stream and table_row("") == gpt_tp == stream + rest
    (padded,) = sentence("transformer.md", r"FSDP's figure is ([\d,]+) bytes above the formula")
    assert padded == padding
    tp = counted[("gpt", "tp", None)]["step"]
    # the rest of the all-gathers and reduce-scatters: the position embedding's, one sequence's
    assert tp["all_gather"]["sent"] + tp["reduce_scatter"]["sent"] - stream == 2 * STREAM // 2
    assert stream == 36 * 16 * STREAM // 2
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
    in_mb = sentence(
        "measurements.md", r"the three strategies send ([\d.]+), ([\d.]+) and ([\d.]+) MB"
    )
    assert in_mb == [f"{sent(counted, 'gpt', s) / 1e6:.1f}" for s in ("ddp", "fsdp", "tp")]
    assert sent(counted, "gpt", "ddp") < at_8 < fsdp


@pytest.mark.slow
@pytest.mark.pages
def test_fsdp_on_gloo_sends_its_reduce_scatters_as_all_reduces(counted):
    """fsdp.md: gloo's bytes, its reduce-scatter an all-reduce of the whole tensor."""
    gloo, times = sentence(
        "fsdp.md", r"BabyCNN's FSDP sends ([\d,]+) bytes, ([\d.]+)× DDP's, in 11 collectives"
    )
    fsdp = counted[("cnn", "fsdp", None)]
    assert fsdp["step"]["reduce_scatter"]["gloo"] == "all_reduce"
    assert gloo == fsdp["sent_per_rank_gloo"] > fsdp["sent_per_rank"]
    assert times == f"{gloo / sent(counted, 'cnn', 'ddp'):.2f}"
    assert sum(row["calls"] for row in fsdp["step"].values()) == 11


@pytest.mark.slow
@pytest.mark.pages
def test_the_rules_crossovers_follow_from_the_bytes_of_each_dtype(counted):
    """parallelism.md: per block (12·C² weights against 8 transfers of tokens × C), TP sends less
    than DDP below 2·g·12/(8·a) tokens per unit of width and than FSDP below (2·p + r)·12/(8·a),
    with g, p, r, a the bytes of an element DDP reduces, FSDP gathers and reduce-scatters, and TP
    sends. Each size is measured here, in fp32 and bf16, from the payloads' ratios."""
    bf16 = {
        s: bytes_per_step.count("gpt", s, log=lambda line: None, precision="bf16")
        for s in ("ddp", "fsdp", "tp")
    }

    def size(result, strategy, kind):  # bytes an element, against fp32's 4
        return 4 * result["step"][kind]["n"] / counted[("gpt", strategy, None)]["step"][kind]["n"]

    crossovers = {}
    for dtype, results in (("fp32", {s: counted[("gpt", s, None)] for s in bf16}), ("bf16", bf16)):
        g = size(results["ddp"], "ddp", "all_reduce")
        p = size(results["fsdp"], "fsdp", "all_gather")
        r = size(results["fsdp"], "fsdp", "reduce_scatter")
        a = size(results["tp"], "tp", "all_gather")
        crossovers[dtype] = (2 * g * 12 / (8 * a), (2 * p + r) * 12 / (8 * a))
    assert crossovers == {"fp32": (3, 4.5), "bf16": (6, 6)}
    text = " ".join((DOCS / "parallelism.md").read_text().split())
    assert "in fp32, TP sends fewer bytes than FSDP below 4.5·C tokens, than DDP below 3·C" in text
    assert "DDP's 2 × 4 bytes a weight and FSDP's 2 + 2 + 4 both make 8" in text
    assert "both crossovers move to 6·C" in text and "24,576 tokens, six sequences of 4k" in text
    assert 6 * 4096 == 24_576
    # the negative control: bf16 halves what FSDP gathers and TP sends, not DDP's
    assert bf16["ddp"]["sent_per_rank"] == sent(counted, "gpt", "ddp")
    assert bf16["tp"]["sent_per_rank"] < 0.51 * sent(counted, "gpt", "tp")
