"""Stop strings and stop regexes: where an answer's text ends it.

Theory of operation
-------------------
A request's :class:`Stops` are its ``stop`` strings and its ``stop_regex`` patterns (Python
``re`` syntax, searched for anywhere in the output's text, as SGLang does). The decode side
ends an answer at the first token after which its decoded output holds one of them. It decodes
only the tail that can hold a match ending in the new token: the longest stop's width in
characters (a string's length; the widest match ``re`` says a regex can make) plus one token (a
token is at least one character). A regex whose matches have no bound (``\\d+``, ``.*END``)
makes the tail the whole output, decoded again after every token: a cost that grows with the
square of the answer's length, as in SGLang.

The answer's text is cut where the first stop in it begins, unless the request keeps it
(``no_stop_trim``), and its finish reason names the stop that matched (a string, or a regex's
pattern). A stream sends only text no stop can still claim (:meth:`Stops.settled`): up to the
first match once there is one, else all but the last ``width - 1`` characters; with an
unbounded regex, nothing before the answer ends.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from lifecycle import SamplingParams

#: A regex whose widest match ``re`` puts beyond this many characters counts as unbounded.
WIDEST = 1 << 16


def regex_width(pattern: re.Pattern[str]) -> int | None:
    """The most characters a match of ``pattern`` can span, or None without a bound."""
    try:
        from re import _parser  # type: ignore[attr-defined]

        widest = int(_parser.parse(pattern.pattern, pattern.flags).getwidth()[1])
    except Exception:  # a private module: if it changes, scan the whole output
        return None
    return widest if widest < WIDEST else None


@attrs.frozen
class Stops:
    """A request's stop strings and compiled stop regexes, and the width of their matches."""

    strings: tuple[str, ...] = ()
    regexes: tuple[re.Pattern[str], ...] = ()
    #: The most characters one match spans; None when a regex has no bound.
    width: int | None = 0

    @classmethod
    def of(cls, params: SamplingParams) -> Stops:
        regexes = tuple(re.compile(p) for p in params.stop_regex)
        widths = [len(s) for s in params.stop] + [regex_width(r) for r in regexes]
        width = None if None in widths else max((w for w in widths if w is not None), default=0)
        return cls(params.stop, regexes, width)

    def __bool__(self) -> bool:
        return bool(self.strings or self.regexes)

    def tail_tokens(self, output: Sequence[int]) -> Sequence[int]:
        """The trailing tokens of ``output`` whose text can hold a match ending in the last."""
        if self.width is None:
            return output
        return output[-(self.width + 1):]

    def matched(self, tail: str) -> str | None:
        """The stop ``tail`` holds: a string, else a regex's pattern; None when none."""
        found = next((s for s in self.strings if s in tail), None)
        if found is None:
            found = next((r.pattern for r in self.regexes if r.search(tail)), None)
        return found

    def cut(self, text: str) -> int:
        """Where the first stop in ``text`` begins (``len(text)`` when none does)."""
        starts = [text.find(s) for s in self.strings]
        starts += [m.start() for m in (r.search(text) for r in self.regexes) if m is not None]
        return min((at for at in starts if at >= 0), default=len(text))

    def settled(self, text: str) -> int:
        """How much of ``text`` (the answer so far) a stream may send: no stop can still claim
        it."""
        cut = self.cut(text)
        if cut < len(text):
            return cut
        if self.width is None:
            return 0
        return max(len(text) - max(self.width - 1, 0), 0)
