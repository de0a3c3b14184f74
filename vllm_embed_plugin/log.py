"""The plugin's logger: a child of vLLM's, so it shares vLLM's handler, format and level."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("vllm.embed_plugin")

_said: set[str] = set()


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log a message once per process (vLLM builds and loads in several processes)."""
    if message not in _said:
        _said.add(message)
        logger.log(level, "vllm-embed-plugin: %s", message)


def every(seconds: float, what: str) -> Callable[[int, int], None]:
    """A progress callback `(done, total)` that logs "what: done of total" at most once per
    `seconds` (a long step inside vLLM shows it is alive without flooding the log)."""
    started = last = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= seconds and done < total:
            last = now
            logger.info(
                "vllm-embed-plugin: %s: %d of %d rows (%.0f%%), %.0f s so far",
                what,
                done,
                total,
                100 * done / max(total, 1),
                now - started,
            )

    return report
