"""The step-time model the TP page quotes (docs/parallelism.md, "Step time" and "Choosing a
layout"), recomputed: docs/step_time.py run afresh, each figure checked against the page and
against the arithmetic it stands for. No launches: it reads the committed results of
bytes_per_step.py and collectives.py (regenerate it after them)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

RESULTS = ROOT / "docs" / "results"


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_time") / "step_time.json"
    command = [sys.executable, str(ROOT / "docs" / "step_time.py"), "--out", out]
    run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


def text():
    return " ".join((ROOT / "docs" / "parallelism.md").read_text().split())


def test_the_gloo_prices_are_the_fits_times_the_counted_collectives(predicted):
    fits = json.loads((ROOT / "benchmarks" / "results" / "collectives.json").read_text())
    fit = next(r for r in fits["results"] if r["world_size"] == 2)["collectives"]
    counted = {
        r["strategy"]: r
        for r in json.loads((RESULTS / "bytes_per_step.json").read_text())
        if r["model"] == "gpt"
    }
    quoted = []
    for strategy, name in (("ddp", "DDP"), ("fsdp", "FSDP"), ("tp", "TP")):
        steps = counted[strategy]["step"].items()
        seconds = sum(
            row["calls"] * fit[k]["alpha_s"] + row["n"] * fit[k]["beta_s_per_byte"]
            for k, row in steps
        )
        row = predicted["gloo"][strategy]
        assert row["seconds"] == pytest.approx(seconds, rel=1e-12)
        assert row["calls"] == sum(r["calls"] for _, r in steps)
        quoted.append((name, row["calls"], f"{seconds * 1e3:.1f}"))
    (ddp, c1, s1), (fsdp, c2, s2), (tp, c3, s3) = quoted
    sentence = f"{ddp}'s {c1} calls take {s1} ms, {fsdp}'s {c2} {s2} ms, {tp}'s {c3} {s3} ms"
    assert sentence in text(), sentence
    # the negative control: latency alone, without the bytes, is another figure
    assert float(s3) > 1.1 * sum(
        row["calls"] * fit[k]["alpha_s"] * 1e3 for k, row in counted["tp"]["step"].items()
    )


def test_the_llama_step_is_compute_plus_what_overlap_leaves(predicted):
    scale = predicted["scale"]
    P, L, T, C = scale["params"], 32, 4096, 4096
    assert scale["flops_token"] == 6 * P + 12 * L * T * C
    assert scale["compute"] == pytest.approx(scale["flops_token"] * 8192 / (0.4 * 989e12))
    rows = scale["layouts"]
    fsdp_nv, fsdp_ib = rows["FSDP in a node (NVLink)"], rows["FSDP across nodes (InfiniBand)"]
    tp, pipeline = rows["TP + SP in a node (NVLink)"], rows["pipeline across nodes (InfiniBand)"]
    assert fsdp_nv["bytes"] == 7 / 8 * 8 * P and fsdp_nv["comm"] == fsdp_nv["bytes"] / 450e9
    # "hidden over NVLink, barely over InfiniBand": under the compute, the second within 10%
    assert fsdp_nv["comm"] < 0.2 * scale["compute"] < 0.9 * scale["compute"] < fsdp_ib["comm"]
    assert fsdp_ib["comm"] <= scale["compute"] == fsdp_ib["step"] == fsdp_nv["step"]
    assert tp["step"] == pytest.approx(scale["compute"] + tp["bytes"] / 450e9)
    m, p = scale["microbatches"], 8
    assert pipeline["step"] == pytest.approx(scale["compute"] * (m + p - 1) / m)
    page = text()
    for quote in (
        f"computes for {scale['compute']:.2f} s at 40% of the bf16 peak",
        f"FSDP sends {fsdp_nv['bytes'] / 1e9:.1f} GB a GPU",
        f"TP + SP sends {tp['bytes'] / 1e9:.1f} GB that every layer waits for: "
        f"a {tp['step']:.2f} s step",
        f"A pipeline sends {pipeline['bytes'] / 1e9:.1f} GB",
        f"{pipeline['step']:.2f} s with {m} microbatches",
        f"| a layer, or its activations | **TP + SP** inside a node | 5.2 GB a sequence, "
        f"a {tp['step']:.2f} s step |",
        f"the bubble: {pipeline['step']:.2f} s |",
    ):
        assert quote in page, quote
