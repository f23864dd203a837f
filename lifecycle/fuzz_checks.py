"""The fuzzer's invariants, its failure reports, and what it knows of records' fields (see
:mod:`lifecycle.fuzzer`).

A report names the rule broken, the event program of the failing run and the timeline of the
request concerned, in states and event names; it never shows a record's repr.
"""

from __future__ import annotations

import collections
import copy
import enum
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from lifecycle.binding import hook_takes_event
from lifecycle.invariants import expected_hook_calls, timeline_violations
from lifecycle.machine import Lifecycle
from lifecycle.record import ADMITTED
from lifecycle.table import LifecycleTable
from lifecycle.weak import PerObject


class RuleBroken(AssertionError):
    """A lifecycle rule was broken; the message names it and shows the program and timeline."""


class CodeRaised(Exception):
    """The code under test (the record class, a guard, ``satisfy``) raised: the message shows
    what raised, the program up to that step and the request's timeline; ``__cause__`` is the
    exception."""


def record_fields(req: Any) -> dict[str, Any]:
    """The record's own fields, copied, for telling whether something changed them."""
    out: dict[str, Any] = {}
    for f in attrs.fields(type(req)):
        if f.name in ("owner", "timeline"):
            continue
        value = getattr(req, f.name)
        try:
            out[f.name] = copy.deepcopy(value)
        except Exception:  # an uncopyable field: compare it by identity
            out[f.name] = value
    return out


#: The fields every record has; the fuzzer never sets them.
_TRACKED_FIELDS = frozenset({"rid", "state", "reason", "detail", "timeline", "owner"})
_SIMPLE: dict[Any, st.SearchStrategy[Any]] = {
    int: st.integers(min_value=-1, max_value=100),
    float: st.floats(min_value=-1.0, max_value=100.0),
    bool: st.booleans(),
    str: st.sampled_from(["", "x", "a longer text"]),
}


def _strategy(tp: Any) -> st.SearchStrategy[Any] | None:
    if tp in _SIMPLE:
        return _SIMPLE[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    args = typing.get_args(tp)
    if args and type(None) in args and len(args) == 2:
        inner = _strategy(next(a for a in args if a is not type(None)))
        return None if inner is None else st.none() | inner
    return None


# Per record class, while it lives (lifecycle.weak).
_FIELD_STRATEGIES: PerObject[type, dict[str, st.SearchStrategy[Any]]] = PerObject()


def field_strategies(record: type) -> dict[str, st.SearchStrategy[Any]]:
    """Strategies for the record's own plain fields (numbers, strings, booleans, enums, and
    optional ones), by name; the fuzzer draws them when it has no ``satisfy`` to make a guard
    hold, so that guards are seen both ways."""
    known = _FIELD_STRATEGIES.get(record)
    if known is not None:
        return known
    try:
        hints = typing.get_type_hints(record)
    except Exception:  # a hint that does not resolve: draw nothing for this class
        hints = {}
    out = _FIELD_STRATEGIES.put(record, {})
    for f in attrs.fields(record) if hints else ():
        strategy = _strategy(hints.get(f.name))
        if f.name not in _TRACKED_FIELDS and f.init and strategy is not None:
            out[f.name] = strategy
    return out


class InHooks:
    """The guard evaluations made while the embedder's hooks ran: those of the events a hook
    fired at other requests, or asked :meth:`~lifecycle.machine.Lifecycle.refusal` about. The
    rule firing an event counts the evaluations its own firing made, and these are not its.
    ``evaluated`` reads the lifecycle's count."""

    __slots__ = ("depth", "evaluated", "guards")

    def __init__(self, evaluated: Callable[[], int]) -> None:
        self.evaluated = evaluated
        self.depth = 0  # hooks running now: a hook run inside another is that one's to count
        self.guards = 0


def counting_hooks(
    table: LifecycleTable,
    user: Mapping[str, Callable[..., None]],
    calls: Mapping[str, collections.Counter[str]],
    in_hooks: InHooks | None = None,
    key: Callable[[Any], str] | None = None,
) -> dict[str, Callable[[Any, Any], None]]:
    """A hook for every hook ``table`` names that counts its calls per request in ``calls``
    (a defaultdict), under ``key(req)`` (default: its id), then calls the embedder's hook of
    that name, if given, in its form, counting in ``in_hooks`` the guard evaluations made
    while it runs."""
    name_of = key or _rid

    def counting(name: str) -> Callable[[Any, Any], None]:
        inner = user.get(name)
        takes = inner is not None and hook_takes_event(table.name, name, inner)

        def hook(req: Any, event: Any) -> None:
            calls[name_of(req)][name] += 1
            if inner is None:
                return
            if in_hooks is None or in_hooks.depth:
                inner(req, event) if takes else inner(req)
                return
            start = in_hooks.evaluated()
            in_hooks.depth += 1
            try:
                inner(req, event) if takes else inner(req)
            finally:
                in_hooks.depth -= 1
                in_hooks.guards += in_hooks.evaluated() - start

        return hook

    return {name: counting(name) for name in table.hooks()}


def _rid(req: Any) -> str:
    rid: str = req.rid
    return rid


def shown_fields(req: Any) -> str:
    """``req``'s own fields as a report shows them (``slots=1, note='x'``; long values cut)."""
    shown = [f"{f.name}={getattr(req, f.name)!r:.40}" for f in attrs.fields(type(req))
             if f.name not in _TRACKED_FIELDS]
    return ", ".join(shown) or "no fields of its own"


def redraw_fields(data: st.DataObject, req: Any) -> str:
    """Set ``req``'s plain fields to drawn values; what was set, for the event program. A value
    the field's validator refuses is not set (the field keeps its value): the record says
    which values it can hold, and the fuzzer keeps to them."""
    fields = attrs.fields_dict(type(req))
    values = {}
    for name, strategy in field_strategies(type(req)).items():
        value = data.draw(strategy, label=name)
        validator = fields[name].validator
        if validator is not None:
            try:
                validator(req, fields[name], value)
            except Exception:  # any refusal: not a value to set
                continue
        values[name] = value
    for name, value in values.items():
        setattr(req, name, value)
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


@attrs.frozen
class Snapshot:
    """What a refused event must leave as it was."""

    states: tuple[enum.IntEnum | None, ...]
    timelines: tuple[int, ...]
    reasons: tuple[enum.Enum | None, ...]
    counts: dict[enum.IntEnum, int]
    finished: dict[tuple[enum.IntEnum, enum.Enum | None], int]
    hook_calls: dict[str, dict[str, int]]
    fired: int

    @classmethod
    def of(
        cls,
        requests: Iterable[Any],
        lifecycle: Lifecycle[Any],
        hook_calls: Mapping[str, collections.Counter[str]],
    ) -> Snapshot:
        reqs = list(requests)
        return cls(
            states=tuple(r.state for r in reqs),
            timelines=tuple(len(r.timeline) for r in reqs),
            reasons=tuple(r.reason for r in reqs),
            counts=lifecycle.counts(),
            finished=dict(lifecycle.finished),
            hook_calls={k: dict(v) for k, v in hook_calls.items()},
            fired=lifecycle.transitions_fired,
        )


def timeline_lines(req: Any, table: LifecycleTable) -> list[str]:
    """``req``'s timeline replayed through ``table``, one line per step."""
    lines, state = [], table.initial
    for step, (t, event) in enumerate(req.timeline):
        if step == 0 and event == ADMITTED:
            lines.append(f"  {t:9.3f}  admitted in {state.name}")
            continue
        edge = table.lookup.get((state, event))
        if edge is None:
            lines.append(f"  {t:9.3f}  {event} from {state.name}: no such edge")
            break
        lines.append(f"  {t:9.3f}  {event}: {state.name} -> {edge.dest.name}")
        state = edge.dest
    if req.state in table.finals:
        reason = req.reason.name if req.reason is not None else "none"
        lines.append(f"  ended {req.state.name}, reason {reason}, detail {req.detail!r}")
    return lines


def report(
    rule_name: str, message: str, program: Sequence[str], req: Any, table: LifecycleTable,
    name: str | None = None,
) -> RuleBroken:
    """The error for a broken rule: the rule, what broke it, the program, the timeline (of
    ``req``, called ``name`` in the program: default, its id)."""
    return RuleBroken(_report_text(f"rule broken: {rule_name}", message, program, req, table,
                                   name))


def raised(message: str, program: Sequence[str], req: Any, table: LifecycleTable,
           name: str | None = None) -> CodeRaised:
    """The error for the code under test raising: what raised, the program, the timeline."""
    return CodeRaised(_report_text("the code under test raised", message, program, req, table,
                                   name))


def _report_text(heading: str, message: str, program: Sequence[str], req: Any,
                 table: LifecycleTable, name: str | None) -> str:
    text = [heading, f"  {message}", "event program:"]
    text += [f"  {i}. {step}" for i, step in enumerate(program, start=1)]
    if req is not None:
        text += [f"timeline of {name or req.rid}:", *timeline_lines(req, table)]
    return "\n".join(text)


class MachineInvariants:
    """The invariants a :class:`~lifecycle.fuzzer.LifecycleMachine` checks after every step."""

    table: LifecycleTable
    lifecycle: Lifecycle[Any]
    requests: dict[str, Any]
    model: dict[str, enum.IntEnum]
    hook_calls: dict[str, collections.Counter[str]]
    checks: tuple[Callable[[Any], object], ...]
    #: The requests the last rule fired at or admitted, and those that hooks admitted or
    #: moved by the events they fired meanwhile.
    touched: set[str]

    def broken(self, rule_name: str, message: str, rid: str | None = None) -> RuleBroken:
        raise NotImplementedError

    def name_of(self, req: Any) -> str:
        """The machine's name for the record ``req``: the key of :attr:`requests`."""
        raise NotImplementedError

    def check_every_invariant(self) -> None:
        """Every invariant below, now (within a rule that takes several steps)."""
        self.states_match_the_model()
        self.index_matches_states()
        self.timelines_replay()
        self.once_hooks_run_exactly_once()
        self.hooks_ran_as_the_edges_say()
        self.finished_counters()
        self.embedder_invariants()

    def _changeable(self) -> list[tuple[str, Any]]:
        """The requests that can have changed since the last check: those the last rule fired
        at or admitted, those an event fired from a hook moved (the model followed them, into
        a final state perhaps), and every one the model has live (a hook may run a live
        request's hooks without moving it, by a self-loop). One the model had ended before
        cannot have: no event fires from a final state (and if it moved, the states say so)."""
        finals = self.table.finals
        rids = self.touched.union(rid for rid, s in self.model.items() if s not in finals)
        return [(rid, self.requests[rid]) for rid in sorted(rids) if rid in self.requests]

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def states_match_the_model(self) -> None:
        for rid, r in self.requests.items():
            if r.state is not self.model[rid]:
                # The model follows the events the rules fire and, from the timelines, those
                # hooks fire: a request that neither moved has a state no event gave it.
                by_hook = "" if rid in self.touched else (
                    " (no rule fired at it, and its timeline shows no event since: its state "
                    "changed without one)")
                raise self.broken(
                    "states follow the table",
                    f"{rid} is in {r.state.name}, the table says {self.model[rid].name}"
                    f"{by_hook}", rid,
                )

    @invariant()
    def index_matches_states(self) -> None:
        try:
            self.lifecycle.check_index()
        except AssertionError as exc:
            raise self.broken("the index files every live request", str(exc)) from None
        finals = self.table.finals
        for rid, r in self.requests.items():
            if r.state in finals:
                # Its id may be live again: a hook may admit a new record under it.
                filed = self.lifecycle.get(r.rid) is not r
            else:
                filed = self.lifecycle.in_state(r.state).get(r.rid) is r
            if not filed:
                raise self.broken("the index files every live request", f"{rid} misfiled", rid)
        # And it files no other: the model holds every request the lifecycle admitted, the
        # machine's and those hooks admitted (adopted after each step).
        if len(self.lifecycle) != sum(s not in finals for s in self.model.values()):
            unknown = sorted(r.rid for r in self.lifecycle.live()
                             if self.requests.get(self.name_of(r)) is not r)
            raise self.broken(
                "the index files every live request",
                f"the lifecycle has live requests the model does not: {', '.join(unknown)}")

    @invariant()
    def timelines_replay(self) -> None:
        for rid, r in self._changeable():
            for problem in timeline_violations(r, self.table):
                raise self.broken("timelines replay through the table", problem, rid)

    @invariant()
    def once_hooks_run_exactly_once(self) -> None:
        for rid, r in self._changeable():
            final = r.state in self.table.finals
            for hook in sorted(self.table.once):
                n = self.hook_calls.get(rid, collections.Counter())[hook]
                if n > 1 or (final and n != 1):
                    raise self.broken(
                        f"once-hook {hook!r} runs exactly once per request",
                        f"hook {hook!r} ran {n} times for {rid}, which is "
                        f"{'finished' if final else 'live'} in {r.state.name}",
                        rid,
                    )

    @invariant()
    def hooks_ran_as_the_edges_say(self) -> None:
        for rid, r in self._changeable():
            want = expected_hook_calls(r, self.table)
            got = self.hook_calls.get(rid, collections.Counter())
            if +got != +want:
                raise self.broken(
                    "hooks run as the edges say", f"{rid}: ran {dict(got)}, expected "
                    f"{dict(want)}", rid,
                )

    @invariant()
    def finished_counters(self) -> None:
        done = collections.Counter(
            (r.state, r.reason) for r in self.requests.values() if r.state in self.table.finals
        )
        if +self.lifecycle.finished != done:
            raise self.broken("finished counters count", "they differ from the requests")

    @invariant()
    def embedder_invariants(self) -> None:
        for check in self.checks:
            name = getattr(check, "__name__", repr(check))
            for rid, r in self.requests.items():
                try:
                    ok = check(r)
                except AssertionError as exc:
                    # The assertion's own message (pytest appends its explanation after it).
                    message = str(exc).splitlines()[0] if str(exc) else "failed"
                    raise self.broken(f"invariant {name}", message, rid) from None
                # None passes (an invariant that asserts); any other falsy result fails.
                if ok is not None and not ok:
                    raise self.broken(f"invariant {name}",
                                      f"false for {rid} ({shown_fields(r)})", rid)
