"""The host's work in a GPT training step (docs/host_work.py), held so it cannot grow back
unseen: the GPT's step at the gpt-gpu sizes issues no more aten:: events and casts than nanoGPT's
model does (issue 62's budgets), and train_ddp.py's loop adds at most 5 % to it."""

import pytest
import torch

from docs import host_work


@pytest.fixture(scope="module")
def model_steps():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {p: host_work.model_step(p) for p in host_work.NANOGPT}
    finally:
        torch.set_num_threads(threads)


def test_the_gpts_step_issues_no_more_host_work_than_nanogpts(model_steps):
    # Budgets: 2,750 events and 340 casts at dropout 0, as nanoGPT's 2,698 and 328 (torch 2.14.1);
    # at 0.2, as much more as nanoGPT's. The control: dropout's masks alone take the step over the
    # dropout-0 budget, so the count sees work of that size.
    assert host_work.BUDGET == {0.0: (2750, 340), 0.2: (3696, 547)}
    for p, (events, casts) in model_steps.items():
        most, most_casts = host_work.BUDGET[p]
        assert 0 < events <= most and 0 < casts <= most_casts, (p, events, casts)
    assert model_steps[0.2][0] > host_work.BUDGET[0.0][0] * 1.2, model_steps


@pytest.mark.slow  # the script at gpt-gpu, 2 steps of 2 x 256 in bf16 on the CPU: a minute
def test_train_ddps_loop_adds_at_most_5_percent_to_the_models_step(model_steps):
    # The script's step (--profile-steps' trace, from one optimizer step's end to the next's) at
    # gpt-gpu's dropout 0.2, against the model's own step at 0.2. The control: against the step at
    # dropout 0 it is more than 5 % over, so the 5 % can fail.
    events, casts = host_work.script_step()
    model, model_casts = model_steps[0.2]
    assert model <= events <= (1 + host_work.SCRIPT_OVER_MODEL) * model, (events, model)
    assert model_casts <= casts <= (1 + host_work.SCRIPT_OVER_MODEL) * model_casts
    assert events > (1 + 4 * host_work.SCRIPT_OVER_MODEL) * model_steps[0.0][0]
