"""A progress bar over one rollout: samples done, tokens/s, acceptance length, samples still running.

Uses tqdm when it is installed (``pip install "samrollout-client[progress]"``); without it
the same figures are logged every few seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("samrollout_client")


class RolloutProgress:
    """Counts started and finished samples, tokens and accepted draft tokens."""

    def __init__(self, total: int, enabled: bool, description: str) -> None:
        self.total, self.enabled, self.description = total, enabled, description
        self.running = self.done = self.tokens = self.accepted = 0
        self.start = self._last_log = time.monotonic()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=description, unit="sample")
            except ImportError:
                self._bar = None

    def started(self) -> None:
        """A sample's request went out."""
        self.running += 1

    def finished(self, sample: Any) -> None:
        """A sample came back (None: it failed)."""
        self.running -= 1
        self.done += 1
        if sample is not None:
            self.tokens += len(sample.token_ids)
            if sample.speculation is not None:
                # vLLM also counts accepted draft tokens the response cut off at max_tokens or a stop string
                self.accepted += min(sample.speculation.num_accepted_draft_tokens, max(0, len(sample.token_ids) - 1))
        if self.enabled:
            self._show()

    def figures(self) -> dict[str, str]:
        """What the bar shows besides the count."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        steps = self.tokens - self.accepted
        mal = f"{self.tokens / steps:.2f}" if self.accepted and steps > 0 else "-"
        return {"tok/s": f"{self.tokens / elapsed:.0f}", "accept_len": mal, "running": str(self.running)}

    def _show(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix(self.figures(), refresh=False)
            self._bar.update(1)
        elif time.monotonic() - self._last_log > 5 or self.done == self.total:
            self._last_log = time.monotonic()
            logger.info("%s: %d/%d samples %s", self.description, self.done, self.total, self.figures())

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
