"""The examples' arithmetic reward scores the final answer the way the model writes it, right or wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from math_reward import arithmetic_reward, correct, final_answer

# What SmolLM2-135M-Instruct writes to "What is a + b?" (from its rollouts), with the answer it gives.
WRITTEN_ANSWERS = [
    ("21 * 8 equals 168.", 168),
    ("28 + 14 = 42", 42),
    ("16 + 10 = 26\n\nSmohlLM \n<<16 + 10 <<<<\n\nOpen the file `99.141234.txt`", 26),
    ("2 + 30 = 2 + 30 = 32", 32),
    ("12 + 2 is 14.", 14),
    ("Here is the answer: 31.", 31),
    ("The answer is 4.", 4),
    ("15 + 21 = \\boxed{36}", 36),
    ("To add 9 + 20, we get 29, so the final answer is 29.", 29),
    ("It is 168", 168),
    ("1,000 + 5 = 1,005.", 1005),
    ("26 + 4 equals 7.", 7),
    ("To find 27 + 8, you simply combine the 27 and the 8, which makes 35.", 35),
    ("-3 + 1 = -2", -2),
    ("5 + 5 = 10.0", 10),
]

NO_ANSWER = [
    "We're welcome to tackle this arithmetic prodigy.",
    "2 + 2 is \"4\", as it is equivalent to \"220\" in Roman numerals.",
    "x = 3.5",
    "",
]


@pytest.mark.parametrize(("response", "answer"), WRITTEN_ANSWERS)
def test_the_final_answer_is_read_as_the_model_writes_it(response: str, answer: int) -> None:
    assert final_answer(response) == answer
    assert correct(response, answer) and not correct(response, answer + 1)


@pytest.mark.parametrize("response", NO_ANSWER)
def test_a_response_without_a_clear_answer_scores_nothing(response: str) -> None:
    assert final_answer(response) is None
    assert arithmetic_reward(response, 4, finished=True, tokens=5, concise_bonus=0.0) == 0.0


def test_the_question_operand_is_not_taken_for_the_answer() -> None:
    assert not correct("21 * 8 equals 168.", 21)  # the first number of the response is the question's own
    assert correct("21 * 8 equals 168.", 168)


def test_the_grpo_reward_adds_its_bonus_only_to_short_responses_that_stopped() -> None:
    assert arithmetic_reward("28 + 14 = 42", 42, finished=True, tokens=11) == 1.5
    assert arithmetic_reward("28 + 14 = 41", 42, finished=True, tokens=11) == 0.5
    assert arithmetic_reward("28 + 14 = 42", 42, finished=False, tokens=11) == 1.0
    assert arithmetic_reward("28 + 14 = 42 " + "and so on " * 10, 42, finished=True, tokens=40) == 1.0


def test_the_areal_example_scores_a_correct_final_answer() -> None:
    from areal_async_grpo import reward

    assert reward("What is 21 * 8?", "21 * 8 equals 168.", [], [], answer=168) == 1.0
    assert reward("What is 21 * 8?", "21 * 8 equals 167.", [], [], answer=168) == 0.0
