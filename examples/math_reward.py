"""A verifiable reward for arithmetic answers written the ways a small chat model writes them.

The examples' rewards read the response's *final* answer, not its first number: "21 * 8 equals
168." answers 168 (the first number is 21, the question's own operand). In order, the answer is:

1. the number in the last ``\\boxed{...}``;
2. else the number after the last "answer is" / "answer:" / "result is" / "final answer";
3. else the first number right after "=", "equals", "is equal to", "makes", "gives" or a number's
   "is" ("12 + 2 is 14") that does not itself begin an expression ("2 + 30 = 2 + 30 = 32"
   answers 32);
4. else the last number of a response that holds only one number ("168.", "It is 168").

Anything else (no number, or several numbers with none of those markers) has no answer and
scores 0. Numbers may carry a sign, thousands separators and a trailing ".0".
"""

from __future__ import annotations

import re

NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_BOXED = re.compile(r"\\boxed\{\s*(" + NUMBER + r")\s*\}")
_STATED = re.compile(r"(?:final answer|answer is|answer:|result is|answer would be)\s*:?\s*\**\s*(" + NUMBER + ")",
                     re.IGNORECASE)
_RESULT = r"(-?\d+(?:,\d{3})*(?:\.\d+)?)(?!\d|\.\d|,\d)(?!\s*[-+*/\u00d7^]\s*\d)"
_AFTER_EQUALS = re.compile(r"(?:=|\bequals\b|\bis equal to\b|(?<=\d) is\b|\bmakes\b|\bgives\b)\s*\**\s*" + _RESULT,
                           re.IGNORECASE)
_ANY_NUMBER = re.compile(NUMBER)


def _as_int(text: str) -> int | None:
    """``text`` as an integer (separators dropped, "42.0" accepted), None when it is not a whole number."""
    cleaned = text.replace(",", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def final_answer(response: str) -> int | None:
    """The whole number a response gives as its answer (the rules in the module docstring), None if it gives none."""
    for pattern in (_BOXED, _STATED):
        found = pattern.findall(response)
        if found:
            return _as_int(found[-1])
    equals = _AFTER_EQUALS.search(response)
    if equals is not None:
        return _as_int(equals.group(1))
    numbers = _ANY_NUMBER.findall(response)
    return _as_int(numbers[0]) if len(numbers) == 1 else None


def correct(response: str, answer: int) -> bool:
    """Whether the response's final answer is ``answer``."""
    return final_answer(response) == answer


def arithmetic_reward(response: str, answer: int, *, finished: bool = True, tokens: int = 0,
                      concise_tokens: int = 24, concise_bonus: float = 0.5) -> float:
    """1 for a correct final answer, plus ``concise_bonus`` for a response that stopped on its own within
    ``concise_tokens`` tokens (0 disables it): the GRPO example's reward, in [0, 1 + concise_bonus]."""
    score = 1.0 if correct(response, answer) else 0.0
    if concise_bonus and finished and 0 < tokens <= concise_tokens:
        score += concise_bonus
    return score
