"""The CUDA defaults (draft range, critical path) are defined once (`samrollout.config`); the Helm values'
comments and the docs repeat them for readers, and fail here when a copy says otherwise."""

from __future__ import annotations

import re
from pathlib import Path

from samrollout.config import CUDA_CRITICAL_PATH_TEXT, CUDA_DRAFT_RANGE_TEXT

ROOT = Path(__file__).resolve().parents[1]
COPIES = [ROOT / "README.md", ROOT / "deploy" / "helm" / "samrollout" / "values.yaml",
          *sorted((ROOT / "docs").glob("*.md"))]
# A draft range written with --k's placeholder (K or k) is the CUDA default range.
RANGE = re.compile(r"\b\d+:\d+,\d+:[Kk]\b")
# A ROWS:K pair said of CUDA (or of the critical path's default) is the CUDA critical path.
CRITICAL = re.compile(r"(?:CUDA(?: GPUs)?:? `?|critical(?:-| )path(?: drafting)?(?: on CUDA)?:? `?)"
                      r"(\d+:\d+)(?!,\d|\d|:)|(\d+:\d+)`? on CUDA", re.IGNORECASE)


def _found(pattern: re.Pattern[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in COPIES:
        for match in pattern.finditer(path.read_text()):
            text = next((g for g in match.groups() if g), match.group(0))
            found.setdefault(text, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_copy_of_the_cuda_draft_range_is_the_default() -> None:
    found = _found(RANGE)
    assert found, "no copy found: the pattern is stale"
    assert {text.upper() for text in found} == {CUDA_DRAFT_RANGE_TEXT.upper()}, found


def test_every_copy_of_the_cuda_critical_path_is_the_default() -> None:
    found = _found(CRITICAL)
    assert found, "no copy found: the pattern is stale"
    assert set(found) == {CUDA_CRITICAL_PATH_TEXT}, found
