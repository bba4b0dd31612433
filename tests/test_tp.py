"""train_tp.py (tensor parallelism inside groups of --tp ranks, FSDP2 across them), launched for
real under torchrun on gloo: the same math as one process, and the mistakes that would break it,
each far off."""

import json
import re

import pytest
from conftest import (
    CONTROL_FLOOR,
    EQUIVALENCE,
    ROOT,
    assert_one_line_error,
    assert_same_math,
    load_weights,
    mnist_args,
    relative_difference,
    run_sh,
    succeeded,
    torchrun,
)


@pytest.mark.parametrize(
    "ranks, flags",
    [
        pytest.param(2, ["--batch-size", "32"], marks=pytest.mark.quick),
        pytest.param(4, ["--batch-size", "8", "--grad-accum", "2"], marks=pytest.mark.slow),
    ],  # -m slow
    ids=["tp2", "tp2-dp2-accumulating"],
)
def test_tensor_parallel_training_matches_one_ddp_process(
    ranks, flags, reference, control, mnist_dir, tmp_path
):
    # Every layer split in two by channels, then (4 ranks) two groups of two sharded by FSDP, with 2
    # micro-steps: global batch 32, as the one process of the reference run.
    path, metrics_path = tmp_path / "tp.pt", tmp_path / "metrics.json"
    succeeded(
        torchrun(
            "train_tp.py",
            ranks,
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            *flags,
            "--tp",
            "2",
            "--save",
            path,
            "--metrics",
            metrics_path,
        )
    )
    assert_same_math(load_weights(path), reference, control)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["global_batch_size"] == 32 and metrics["mesh"] == [ranks // 2, 2]


# What would break it, each in a copy of the script: pytorch/examples' TP example built its
# optimizer before the split, so the optimizer held tensors the model no longer used, and nothing
# trained; without the backward's all-reduce, each rank's input gradient is only its own channels'
# part.
BREAKS = {
    "optimizer-before-the-split": lambda text: re.sub(
        r"\n    optimizer = training.make_optimizer\(.*", "", text
    ).replace(
        "    # ---- wrap:",
        "    optimizer = training.make_optimizer(args, model.parameters())\n    # ---- wrap:",
    ),
    "no-all-reduce-in-backward": lambda text: text.replace(
        "AllReduceBackward.apply(x, group)", "x"
    ),
}


@pytest.mark.slow  # the equivalence test above has its own negative control
@pytest.mark.parametrize("name", BREAKS)
def test_each_mistake_trains_another_model(name, reference, mnist_dir, tmp_path):
    text = (ROOT / "train_tp.py").read_text()
    broken = BREAKS[name](text)
    assert broken != text, "the script changed: the break no longer applies"
    # it imports plumbing and models from the repository (PYTHONPATH)
    script = tmp_path / "train_tp.py"
    script.write_text(broken)
    succeeded(
        torchrun(
            script,
            2,
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            "--batch-size",
            "32",
            "--save",
            tmp_path / "tp.pt",
        )
    )
    assert relative_difference(load_weights(tmp_path / "tp.pt"), reference) > CONTROL_FLOOR


def test_a_layout_that_does_not_divide_is_one_line(tmp_path):
    run = run_sh("train_tp.py", 2, "--tp", "3", "--dataset", "synthetic")
    run.wait()
    assert_one_line_error(
        run,
        "error: --tp 3 must divide the world size 2 and BabyCNN's 8 channels (8 x --width), "
        "which it splits",
    )


@pytest.mark.slow
def test_the_collectives_and_the_bytes_per_rank_are_what_the_page_predicts():
    # 2 groups of 2: the tp all-reduces and FSDP's all-gathers and reduce-scatters of one step,
    # counted by CommDebugMode; and each rank's weights, gradients and AdamW moments, 1/(dp x tp) of
    # the model's, but for the row-wise layers' biases (whole in each tp group) and AdamW's step
    # counters.
    run = succeeded(torchrun("benchmarks/tp_collectives.py", 4, "--tp", "2"))
    result = json.loads(next(line for line in run.output.splitlines() if line.startswith("{")))
    assert result["forward"] == result["predicted_forward"] == {"all_reduce": 4, "all_gather": 4}
    assert (
        result["backward"]
        == result["predicted_backward"]
        == {"all_reduce": 3, "all_gather": 3, "reduce_scatter": 4}
    )
    share = result["whole_over_dp_tp"]
    assert all(share < state < 1.01 * share for state in result["state_bytes"]), result


@pytest.mark.slow
def test_the_tp_plans_collectives_are_what_the_benchmark_predicts():
    # tp_plan() on 2 groups of 2, 4 blocks: sequence parallelism's all-gathers before the
    # column-wise layers (9) and reduce-scatters after the row-wise ones and the embeddings (10),
    # swapped in backward; loss_parallel's 3 all-reduces; one all-reduce per norm weight (9):
    # partial sums over each rank's positions. FSDP's on top, for 5 units (4 blocks, the root with
    # the tied embedding and head): 5 all-gathers in forward, 4 in backward, 5 reduce-scatters.
    # The state: 1/(dp x tp) but for the replicated norms and the vocabulary's 65 rows, split 33
    # and 32.
    run = succeeded(torchrun("benchmarks/tp_collectives.py", 4, "--tp", "2", "--model", "gpt"))
    result = json.loads(next(line for line in run.output.splitlines() if line.startswith("{")))
    assert (
        result["forward"]
        == result["predicted_forward"]
        == {"all_gather": 9 + 5, "reduce_scatter": 10, "all_reduce": 3}
    )
    assert (
        result["backward"]
        == result["predicted_backward"]
        == {"all_gather": 10 + 4, "reduce_scatter": 9 + 5, "all_reduce": 9}
    )
    share = result["whole_over_dp_tp"]
    assert all(share < state < 1.01 * share for state in result["state_bytes"]), result
