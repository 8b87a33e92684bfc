"""A random source for dry runs: draws what the scheduler's RNG would draw, without advancing it.

A ``Schedule`` dry run must make the decision ``Generate`` would make now, so
it has to see the same random draws (ties, top-k, power-of-two) and must not
consume them. Copying the generator's state up front costs ~0.1 ms per call
(Mersenne Twister state is 625 words), and most decisions draw nothing; so the
copy is taken at the first draw instead.
"""

from __future__ import annotations

import random
from typing import Any


class ForkOnFirstDraw(random.Random):
    """Behaves as a copy of ``source`` taken at its first draw; ``source`` is never advanced."""

    def __init__(self, source: random.Random) -> None:
        # No super().__init__(): it would seed (and cost) for nothing; the state comes from
        # ``source`` before any draw.
        self._source = source
        self._forked = False

    def _fork(self) -> None:
        super().setstate(self._source.getstate())
        self._forked = True

    def random(self) -> float:
        if not self._forked:
            self._fork()
        return super().random()

    def getrandbits(self, k: int, /) -> int:
        if not self._forked:
            self._fork()
        return super().getrandbits(k)

    def getstate(self) -> tuple[Any, ...]:
        if not self._forked:
            self._fork()
        return super().getstate()

    def seed(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a ForkOnFirstDraw takes its state from its source; it cannot be seeded")
