"""Stop strings and stop regexes: where an answer's text ends it.

Theory of operation
-------------------
A request's :class:`Stops` are its ``stop`` strings and its ``stop_regex`` patterns (Python
``re`` syntax, searched for anywhere in the output's text, as SGLang does). The decode side
ends an answer at the first token after which its decoded output holds one of them. It decodes
only the tail that can hold a match ending in the new token: the longest stop's width in
characters (a string's length; the widest match ``re`` says a regex can make) plus one token (a
token is at least one character). A regex whose matches have no bound (``\\d+``, ``.*END``), or
that asserts something about the text around its match (a lookaround, ``^``, ``\\A``, ``\\b``:
at a tail's first character ``^`` would hold), makes the tail the whole output, decoded again
after every token: a cost that grows with the square of the answer's length, as in SGLang.

The answer's text is cut where the first stop in it begins, unless the request keeps it
(``no_stop_trim``), and its finish reason names the stop that matched (a string, or a regex's
pattern). A stream sends only text no stop can still claim (:meth:`Stops.settled`): up to the
first match once there is one, else all but the last ``width - 1`` characters; with a regex
of no width (unbounded, or asserting about its context), nothing before the answer ends.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from lifecycle import SamplingParams

#: A regex whose widest match ``re`` puts beyond this many characters counts as unbounded.
WIDEST = 1 << 16


def regex_width(pattern: re.Pattern[str]) -> int | None:
    """The most characters a match of ``pattern`` can span, or None when the match alone does
    not bound the text it needs: no bound on its width, or an assertion about the text around
    it (a lookaround, ``^``, ``\\A``, ``\\b``), which a tail cut out of the output would
    answer wrongly (``^`` would hold at the tail's start)."""
    try:
        from re import _parser  # type: ignore[attr-defined]

        parsed = _parser.parse(pattern.pattern, pattern.flags)
        if _needs_context(parsed):
            return None
        widest = int(parsed.getwidth()[1])
    except Exception:  # a private module: if it changes, scan the whole output
        return None
    return widest if widest < WIDEST else None


def _needs_context(tree: Any) -> bool:
    """Whether a parsed pattern (``re._parser``'s tree) asserts anything about the text before
    or around its match; end anchors (``$``, ``\\Z``) see the same end in a tail."""
    from re import _constants  # type: ignore[attr-defined]

    ends = {_constants.AT_END, _constants.AT_END_STRING, _constants.AT_END_LINE}
    looks = {_constants.ASSERT, _constants.ASSERT_NOT}
    for op, av in tree:
        if op in looks or (op == _constants.AT and av not in ends):
            return True
        if any(_needs_context(sub) for sub in _subtrees(av)):
            return True
    return False


def _subtrees(av: Any) -> Iterator[Any]:
    """The nested patterns in an item's argument (groups, branches, repeats)."""
    from re import _parser  # type: ignore[attr-defined]

    if isinstance(av, _parser.SubPattern):
        yield av
    elif isinstance(av, tuple | list):
        for part in av:
            yield from _subtrees(part)


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
        """The stop that begins first in ``tail`` (a string, or a regex's pattern; a string
        before a regex, then in the request's order, where two begin together); None when
        none is there. The answer's text is cut where it begins."""
        found = [(at, s) for s in self.strings if (at := tail.find(s)) >= 0]
        found += [(m.start(), r.pattern) for r in self.regexes if (m := r.search(tail))]
        return min(found, key=lambda f: f[0])[1] if found else None

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
