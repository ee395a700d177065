"""`suffix-best`: vLLM's `suffix` at the best of the settings a user could pick, per projection.

The grid (`GRID`): tree depth {24, 64} x k (num_speculative_tokens) {8, 16, 32} x spec factor {1, 2}, with the
global tree holding 100,000 requests, min_token_prob at vLLM's 0.1.  ``suffix-best`` in a mode list stands for
every point of the grid (`expand`); the projection reports the fastest (`best`) under the name
``suffix-best``, with its setting.  `samrollout simulate-rl` picks the point in the cheaper synchronous
rollout of `samrollout simulate` and then runs only the winner through the loops (`samrollout.sim.rl_command`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import product

BEST = "suffix-best"
DEPTHS = (24, 64)
KS = (8, 16, 32)
SPEC_FACTORS = (1, 2)
CACHED_REQUESTS = 100_000


def grid_modes(suffix_of: str = "") -> list[str]:
    """The grid's mode names (``suffix-dD-kK-fF-n100000``), each with the ``+scheduling`` suffix given."""
    return [f"suffix-d{d}-k{k}-f{f}-n{CACHED_REQUESTS}{suffix_of}" for d, k, f in product(DEPTHS, KS, SPEC_FACTORS)]


def expand(modes: Iterable[str]) -> list[str]:
    """The mode list with each ``suffix-best[+scheduling]`` replaced by the grid's modes (order kept, no repeats)."""
    out: list[str] = []
    for mode in modes:
        for name in grid_modes(mode[len(BEST):]) if mode.split("+")[0] == BEST else [mode]:
            if name not in out:
                out.append(name)
    return out


def best(names: Iterable[str], rate: Callable[[str], float]) -> str:
    """The grid mode with the highest ``rate`` (tokens/s, or minus the makespan); the first on ties."""
    names = list(names)
    if not names:
        raise ValueError("no suffix-best grid mode ran")
    return max(names, key=rate)


def grid_of(best_mode: str, modes: Iterable[str]) -> list[str]:
    """The grid modes (among ``modes``) that ``suffix-best[+scheduling]`` stands for."""
    wanted = set(grid_modes(best_mode[len(BEST):]))
    return [m for m in modes if m in wanted]
