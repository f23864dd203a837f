"""Stop strings and stop regexes: where an answer's text ends it.

Theory of operation
-------------------
A request's :class:`Stops` are its ``stop`` strings and its ``stop_regex`` patterns (Python
``re`` syntax, searched for anywhere in the output's text, as SGLang does). The decode side
ends an answer at the first token after which its decoded output holds one of them. It decodes
only the tail that can hold a match ending in the new token: the longest stop's width in
characters (a string's length; the widest match ``re`` says a regex can make), in tokens: four
per character (a token is at least one byte, and a character at most four: a byte-fallback
tokenizer spells ``界`` in three tokens), plus one. A regex whose matches have no bound
(``\\d+``, ``.*END``), or that asserts something about the text around its match (a
lookaround, ``^``, ``\\A``, ``\\b``: at a tail's first character ``^`` would hold), makes the
tail the whole output, decoded again after every token: a cost that grows with the square of
the answer's length, as in SGLang.
Searching less would change what matches: a start that failed can succeed once the text
grows, and a token can change the text decoded before it (a byte-fallback piece completing a
character), so no part of the output stays searched.

The tail is decoded after the :data:`CONTEXT_TOKENS` tokens before it (the prompt's, where it
starts the output) and cut after their text, as the answer's text is decoded after the
prompt: a tokenizer that strips the space a text starts with (SentencePiece's ``▁``) would
otherwise drop the tail's, and a stop that begins with a space at the answer's start (`` the``)
would never match.

The regexes are searched with the ``regex`` module in its ``re``-compatible mode (VERSION0),
not with ``re``: a pattern that backtracks catastrophically (``(a|a)+b`` on a run of ``a``)
takes time exponential in the text's length, and ``re`` would hold the GIL throughout, freezing
every thread of the worker (health checks, other requests, signal handlers). ``regex``
releases the GIL while it searches and stops at a deadline: one search of a text for all of a
request's regexes may take :data:`SEARCH_BUDGET_S`, and one that runs past it raises
:class:`StopRegexTooSlow`, which fails that request (400: the pattern is the client's to
change). Where the two modules read a pattern differently, ``regex``'s reading holds: a set
that starts with ``[:`` (``[[:alpha:]]``) is a POSIX class to it (``re`` warns of a change).

The answer's text is cut where the first stop in it begins, unless the request keeps it
(``no_stop_trim``), and its finish reason names the stop that matched (a string, or a regex's
pattern). A stream sends only text no stop can still claim (:meth:`Stops.settled`): up to the
first match once there is one, else all but the last ``width - 1`` characters; with a regex
of no width (unbounded, or asserting about its context), nothing before the answer ends.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import regex

from lifecycle import SamplingParams

#: Tokens before a tail that it is decoded after (as SGLang's incremental detokenization
#: window, and the answer's text after the prompt: ``scheduler.service.answers``).
CONTEXT_TOKENS = 5

#: A regex whose widest match ``re`` puts beyond this many characters counts as unbounded.
WIDEST = 1 << 16

#: The seconds one search of a text for a request's stop regexes (all of them) may take. A
#: pattern that does not backtrack searches a 128,000-character output in under a millisecond,
#: so this leaves it ample room; and the decode loop searches between steps, so it bounds how
#: long one request's patterns can hold up every answer of its batch (a step takes tens of
#: milliseconds), and the HTTP server's event loop the same.
SEARCH_BUDGET_S = 0.05


class StopRegexTooSlow(ValueError):
    """A search for a request's stop regexes ran past :data:`SEARCH_BUDGET_S`: the pattern it
    was searching for backtracks too much, and the request fails (400)."""

    def __init__(self, pattern: str, chars: int) -> None:
        super().__init__(
            f"stop_regex {pattern!r} took too long on the output: searching its {chars} "
            f"characters ran past the {SEARCH_BUDGET_S * 1000:.0f} ms a search may take (a "
            "pattern that backtracks catastrophically, such as nested repeats like (a+)+); "
            "simplify the pattern")
        self.pattern = pattern


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


def decoded_after(detokenize: Callable[[Sequence[int]], str], context: Sequence[int],
                  ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``context``: decoded after it and cut after its text, or
    decoded alone where the two do not join at a character boundary (or there is no context)."""
    if not context or not ids:
        return detokenize(ids)
    before = detokenize(context)
    joined = detokenize([*context, *ids])
    if joined.startswith(before) and not before.endswith("\ufffd"):
        return joined[len(before):]
    return detokenize(ids)


@attrs.frozen
class Stops:
    """A request's stop strings and compiled stop regexes, and the width of their matches."""

    strings: tuple[str, ...] = ()
    #: Compiled by ``regex`` (VERSION0: ``re``'s syntax and meaning).
    regexes: tuple[regex.Pattern[str], ...] = ()
    #: The most characters one match spans; None when a regex has no bound.
    width: int | None = 0

    @classmethod
    def of(cls, params: SamplingParams) -> Stops:
        """The request's stops. Raises ``ValueError`` for a pattern ``regex`` (which searches)
        or ``re`` (whose parser gives its width) does not take: ``SamplingParams`` refuses
        those, so only a record built around its checks gets here with one."""
        regexes = []
        widths: list[int | None] = [len(s) for s in params.stop]
        for pattern in params.stop_regex:
            try:
                regexes.append(regex.compile(pattern, regex.VERSION0))
                widths.append(regex_width(re.compile(pattern)))
            except (regex.error, re.error) as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a regular expression this "
                                 f"server can search for: {exc}") from exc
        width = None if None in widths else max((w for w in widths if w is not None), default=0)
        return cls(params.stop, tuple(regexes), width)

    def __bool__(self) -> bool:
        return bool(self.strings or self.regexes)

    def tail_tokens(self, output: Sequence[int]) -> Sequence[int]:
        """The trailing tokens of ``output`` whose text can hold a match ending in the last."""
        if self.width is None:
            return output
        # A character can take up to 4 tokens (byte-fallback pieces of its UTF-8 bytes), and
        # the first token of the tail may end inside the match's first character.
        return output[-(4 * self.width + 1):]

    def tail_text(self, detokenize: Callable[[Sequence[int]], str], prompt: Sequence[int],
                  output: Sequence[int]) -> str:
        """The text of :meth:`tail_tokens` as it stands in the answer's text: decoded after
        the :data:`CONTEXT_TOKENS` tokens before it (the prompt's where it starts the output)
        and cut after theirs, or decoded alone where the two do not join at a character
        boundary."""
        tail = self.tail_tokens(output)
        start = len(output) - len(tail)
        before = list(output[max(start - CONTEXT_TOKENS, 0):start])
        if len(before) < CONTEXT_TOKENS and prompt:
            before[:0] = prompt[-(CONTEXT_TOKENS - len(before)):]
        return decoded_after(detokenize, before, tail)

    def matched(self, tail: str) -> str | None:
        """The stop that begins first in ``tail`` (a string, or a regex's pattern; a string
        before a regex, then in the request's order, where two begin together); None when
        none is there. The answer's text is cut where it begins. Raises
        :class:`StopRegexTooSlow`."""
        found = [(at, s) for s in self.strings if (at := tail.find(s)) >= 0]
        found += self._regex_starts(tail)
        return min(found, key=lambda f: f[0])[1] if found else None

    def cut(self, text: str) -> int:
        """Where the first stop in ``text`` begins (``len(text)`` when none does). Raises
        :class:`StopRegexTooSlow`."""
        starts = [at for s in self.strings if (at := text.find(s)) >= 0]
        starts += [at for at, _ in self._regex_starts(text)]
        return min(starts, default=len(text))

    def _regex_starts(self, text: str) -> list[tuple[int, str]]:
        """Where each regex's first match in ``text`` begins, with its pattern (those that
        match, in the request's order), searched within :data:`SEARCH_BUDGET_S` in all."""
        found: list[tuple[int, str]] = []
        deadline = time.monotonic() + SEARCH_BUDGET_S
        for compiled in self.regexes:
            pattern: str = compiled.pattern
            try:
                # concurrent: the GIL is released while it searches.
                match = compiled.search(text, concurrent=True,
                                        timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError as exc:
                raise StopRegexTooSlow(pattern, len(text)) from exc
            if match is not None:
                found.append((int(match.start()), pattern))
        return found

    def settled(self, text: str) -> int:
        """How much of ``text`` (the answer so far) a stream may send: no stop can still claim
        it. Raises :class:`StopRegexTooSlow`."""
        cut = self.cut(text)
        if cut < len(text):
            return cut
        if self.width is None:
            return 0
        return max(len(text) - max(self.width - 1, 0), 0)
