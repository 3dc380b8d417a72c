"""Weight-version spans: which policy weights produced which tokens of a call.

A span is `(version, start, end)`: tokens at positions [start, end) were sampled by weight
version `version`. A call's spans cover its generated tokens [0, n) without gaps, in order,
with versions that never decrease (a worker's weights only move forward while a call runs).
With in-flight weight updates a call has several; a resumed or migrated call keeps its
prefix's spans and adds the tail's. Chunk rows carry the spans of their own tokens, terminal
rows and token entries a whole call's, training rows the spans of every generated token at its
place in the sequence (the prompt and environment tokens between turns are in no span).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

Span = tuple[int, int, int]
NO_VERSION = -1  # a position no span covers (prompt and environment tokens)


class SpanError(ValueError):
    """Spans that do not describe one call's tokens (gaps, overlaps, out of order)."""


def check_spans(spans: Sequence[Span], start: int, end: int) -> None:
    """Raise SpanError unless `spans` cover [start, end) exactly, in order, each non-empty,
    with versions that never decrease."""
    at = start
    for v, s, e in spans:
        if s != at or e <= s or v < 0:
            raise SpanError(f"span ({v}, {s}, {e}) does not continue at {at}")
        at = e
    if at != end:
        raise SpanError(f"spans end at {at}, the tokens at {end}")
    if any(b[0] < a[0] for a, b in itertools.pairwise(spans)):
        raise SpanError("weight versions decrease")


def merged(spans: Iterable[Span]) -> list[Span]:
    """Adjacent spans of one version as one."""
    out: list[Span] = []
    for v, s, e in spans:
        if out and out[-1][0] == v and out[-1][2] == s:
            out[-1] = (v, out[-1][1], e)
        else:
            out.append((v, s, e))
    return out


def clipped(spans: Iterable[Span], start: int, end: int) -> list[Span]:
    """The parts of `spans` inside [start, end)."""
    return [(v, max(s, start), min(e, end)) for v, s, e in spans if min(e, end) > max(s, start)]


def from_starts(starts: Sequence[tuple[int, int]], n: int, first: int) -> list[Span]:
    """Spans over [0, n) from (version, first position) switch points, as an engine tracks
    them; `first` covers the positions before the first switch point."""
    points = [(v, s) for v, s in starts if s < n]
    if not points or points[0][1] > 0:
        points.insert(0, (first, 0))
    ends = [s for _, s in points[1:]] + [n]
    return merged((v, s, e) for (v, s), e in zip(points, ends, strict=True) if e > s)


def resumed(prefix: Sequence[Span], tail: Sequence[Span], k: int, n: int) -> list[Span]:
    """A resumed call's spans over [0, n): its prefix's over [0, k), then the engine's from k
    on (whatever the engine says of positions before k is the prefix's, not its own)."""
    return merged([*clipped(prefix, 0, k), *clipped(tail, k, n)])


def shifted(spans: Iterable[Span], offset: int) -> list[Span]:
    return [(v, s + offset, e + offset) for v, s, e in spans]


def per_token(spans: Iterable[Span], n: int) -> np.ndarray:
    """Each position's version (NO_VERSION where no span covers it)."""
    out = np.full(n, NO_VERSION, np.int64)
    for v, s, e in spans:
        out[s:e] = v
    return out


def version_range(spans: Sequence[Span]) -> tuple[int, int] | None:
    """(oldest, newest) version in `spans`; None when there are none."""
    if not spans:
        return None
    versions = [v for v, _, _ in spans]
    return min(versions), max(versions)
