"""A request's text against its stop strings: cut at the first stop to end, and hold back a tail
that could still become one, so that streamed text never shows the start of a stop.

The invariant: the released text never contains the beginning of a stop string that the
text may still complete. Every tail of the text that is a proper prefix of a stop is held
(at most the longest stop's length minus one character) until the text moves past it or
the request finishes; so the concatenated deltas equal the final text, whether the text
arrives a character, a token or many tokens at a time.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """The text of one request so far, and how much of it has been released."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        """The text so far, cut before the first stop string once one has appeared."""
        self.num_released = 0
        """Characters of `text` handed out so far."""
        self.stopped = False
        """Whether a stop string has appeared (the text ends before it)."""

    @property
    def released(self) -> str:
        """The text handed out so far."""
        return self.text[:self.num_released]

    def add(self, delta: str, final: bool) -> str:
        """Append `delta` and return what may be released now: everything when the request
        is `final` or a stop string has appeared, else all but a tail that could still
        begin a stop."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.text += delta
        if self.stops and delta:
            # a stop found now ends in `delta`: it starts at most longest - 1 before it
            start = max(0, before - self.longest + 1)
            # The stop that ends first wins (of those, the one that starts first), as if
            # the text came a character at a time: the cut does not depend on the deltas.
            hits = [(i + len(s), i) for s in self.stops if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[:min(hits)[1]]
                self.stopped = True
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        out = self.text[self.num_released:end]
        self.num_released = max(self.num_released, end)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
