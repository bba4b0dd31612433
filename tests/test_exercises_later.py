"""The exercises of the pipeline, parallelism, checkpoints and cluster pages, checked as
tests/test_exercises.py checks the others': in a file of their own, so that CI's two pytest-xdist
workers (--dist loadfile) share the exercises' launches, minutes of them."""

import pytest
from test_exercises import LATER, all_exercises, check_answers, runs  # noqa: F401 (a fixture)


@pytest.mark.slow
@pytest.mark.pages
@pytest.mark.parametrize("page, index", all_exercises(LATER))
def test_the_exercise_answers_are_what_the_runs_give(runs, page, index):  # noqa: F811
    check_answers(runs, page, index)
