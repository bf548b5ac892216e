"""Per-key rate limiting at the ingress: a token bucket per API key.

Each key may send ``rate`` requests per second on average and ``burst`` at once; a
request over that gets a 429 with ``Retry-After`` from :class:`helix_ray.serve.gate.Gate`
before its body is read. Each ingress replica counts its own requests (no shared state),
so a deployment of n replicas lets a key through up to n times the rate. Off unless
``ServeArgs.rate_limit`` sets a rate; a server without keys (``--no-auth``) has none to
count by.
"""

from __future__ import annotations

import math
import threading
import time


class RateLimiter:
    """Token buckets keyed by API key id: ``burst`` tokens, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: int):
        if rate <= 0 or burst < 1:
            raise ValueError(f"Got rate={rate}, burst={burst}; the rate must be > 0 and the burst at least 1.")
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, when counted)
        self._lock = threading.Lock()

    def wait(self, key_id: str, now: float | None = None) -> float:
        """Take a token for ``key_id``: 0.0 if there was one, else the seconds until there is
        (and none is taken)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, then = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / self.rate


def retry_after(wait_s: float) -> int:
    """``Retry-After`` in whole seconds (at least 1) for a wait of ``wait_s``."""
    return max(1, math.ceil(wait_s))


#: The limiter of the ingress replica in this process (None: no limit), registered by
#: :class:`helix_ray.serve.app.HelixAPI` for the gate, as ``keys.SERVING`` is.
SERVING: dict[str, RateLimiter | None] = {"limiter": None}
