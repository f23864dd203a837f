"""Binding a table to code: guards and hooks called by their signature on both firing paths,
names checked before anything fires, trigger methods from the table, event enums, reasons,
and what a batch looks like when a hook raises."""

from __future__ import annotations

import copy
import enum
import functools
import pickle
import re
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

from lifecycle import (
    Edge,
    Firing,
    GuardFailed,
    HookFailed,
    IllegalTransition,
    InvalidTable,
    Lifecycle,
    LifecycleError,
    LifecycleTable,
    MissingHook,
    Tracked,
    Trigger,
    make_table,
)
from lifecycle.timeline import to_perfetto


class S(enum.IntEnum):
    FAILED = 0
    CANCELLED = 1
    CREATED = 2
    PAID = 3
    DONE = 4


class E(enum.StrEnum):
    PAY = "pay"
    FINISH = "finish"
    CANCEL = "cancel"
    FAIL = "fail"


class Why(enum.Enum):
    DECLINED = "declined"


LIVE = (S.CREATED, S.PAID)
FINALS = (S.DONE, S.CANCELLED, S.FAILED)


def edges(pay_guard: str = "paid_in_full", finish_guard: str = "ready") -> tuple[Edge, ...]:
    return (
        Edge(E.PAY, S.CREATED, S.PAID, conditions=pay_guard, after="charge"),
        Edge(E.FINISH, S.PAID, S.DONE, unless=finish_guard),
        *(Edge(E.CANCEL, s, S.CANCELLED) for s in LIVE),
        *(Edge(E.FAIL, s, S.FAILED) for s in LIVE),
    )


def table(record: type | None = None, name: str = "shop", **overrides: Any) -> LifecycleTable:
    kwargs: dict[str, Any] = {
        "events": E,
        "initial": S.CREATED,
        "finals": FINALS,
        "edges": edges(),
        "failure_events": (E.CANCEL, E.FAIL),
        "on_enter": {f: ("release", "notify") for f in FINALS},
        "reasons": Why,
        "record": record,
    }
    kwargs.update(overrides)
    return make_table(name, S, **kwargs)


# Guards in both forms: one without the event, one told what is being fired.
@attrs.define(slots=True, eq=False, weakref_slot=False)
class Order(Tracked):
    total: int = attrs.field(default=10, kw_only=True)
    paid: int = attrs.field(default=0, kw_only=True)
    seen: list[Firing] = attrs.field(factory=list, kw_only=True, repr=False)

    pay: ClassVar[Trigger]

    def paid_in_full(self) -> bool:
        return self.paid >= self.total

    def ready(self, event: Firing) -> bool:
        self.seen.append(event)
        return False


TABLE = table(Order)


class Shop:
    """Hooks in both forms, recording what they were called with."""

    def __init__(self, raising: str = "") -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.raising = raising
        self.lc: Lifecycle[Order] = Lifecycle(
            TABLE, {"charge": self.charge, "release": self.release, "notify": self.notify}
        )

    def charge(self, order: Order) -> None:
        self.calls.append(("charge", order.rid, order.state.name if order.state else "?"))

    def release(self, order: Order) -> None:
        self.calls.append(("release", order.rid, order.state.name if order.state else "?"))
        if order.rid == self.raising:
            raise RuntimeError("the warehouse is closed")

    def notify(self, order: Order, event: Firing) -> None:
        self.calls.append(("notify", order.rid, f"{event.source.name}>{event.event}"))

    def orders(self, *rids: str, paid: int = 0) -> list[Order]:
        out = [Order(rid, paid=paid) for rid in rids]
        for o in out:
            self.lc.admit(o)
        return out


@pytest.mark.parametrize("one_by_one", [True, False], ids=["trigger", "batch"])
def test_guards_and_hooks_in_both_forms_on_both_paths(one_by_one: bool) -> None:
    shop = Shop()
    (a,) = shop.orders("a")
    fire = (lambda ev, o: o.fire(ev)) if one_by_one else (lambda ev, o: shop.lc.fire(ev, [o]))
    with pytest.raises(GuardFailed, match="paid_in_full is false"):
        fire(E.PAY, a)
    a.paid = 10
    fire(E.PAY, a)
    with pytest.raises(IllegalTransition):
        fire(E.PAY, a)  # no edge from PAID
    fire(E.FINISH, a)  # unless=ready: ready() is False, so it fires
    assert a.state is S.DONE
    assert [(f.event, f.source, f.dest) for f in a.seen] == [(E.FINISH, S.PAID, S.DONE)]
    assert shop.calls == [
        ("charge", "a", "PAID"), ("release", "a", "DONE"), ("notify", "a", "PAID>finish"),
    ]


def logged(fn: Any) -> Any:
    """A decorator as most are written: every wrapper it makes shares one code object."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Wrapped(Tracked):
    paid: int = attrs.field(default=0, kw_only=True)
    seen: list[Firing] = attrs.field(factory=list, kw_only=True, repr=False)

    @logged
    def paid_in_full(self) -> bool:
        return self.paid > 0

    @logged
    def ready(self, event: Firing) -> bool:
        self.seen.append(event)
        return False


@pytest.mark.parametrize("one_by_one", [True, False], ids=["trigger", "batch"])
def test_decorated_guards_and_hooks_are_called_by_their_own_signatures(one_by_one: bool) -> None:
    """A decorator's wrappers share one code object; each is called as the function it wraps
    is written (functools.wraps' __wrapped__), whichever was read first."""
    calls: list[tuple[str, ...]] = []

    @logged
    def charge(order: Wrapped) -> None:
        calls.append(("charge", order.rid))

    @logged
    def notify(order: Wrapped, event: Firing) -> None:
        calls.append(("notify", order.rid, str(event.event)))

    @logged
    def release(order: Wrapped) -> None:
        calls.append(("release", order.rid))

    lc: Lifecycle[Wrapped] = Lifecycle(
        table(Wrapped), {"charge": charge, "release": release, "notify": notify})
    a = Wrapped("a", paid=1)
    lc.admit(a)
    fire = (lambda ev: a.fire(ev)) if one_by_one else (lambda ev: lc.fire(ev, [a]))
    fire(E.PAY)
    fire(E.FINISH)
    assert a.state is S.DONE
    assert [(f.event, f.dest) for f in a.seen] == [(E.FINISH, S.DONE)]
    assert calls == [("charge", "a"), ("release", "a"), ("notify", "a", "finish")]


def test_a_guard_replaced_on_the_class_reaches_only_lifecycles_that_bind_it_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lifecycle looks its guards up when it binds the record class (built with the table's
    record=, here), and keeps calling those: a monkeypatch reaches lifecycles built after it."""
    bound_before = Shop()
    monkeypatch.setattr(Order, "paid_in_full", lambda self: True)
    bound_after = Shop()
    (a,) = bound_before.orders("a")
    (b,) = bound_after.orders("b")
    with pytest.raises(GuardFailed, match="paid_in_full is false"):
        a.pay()
    b.pay()
    assert (a.state, b.state) == (S.CREATED, S.PAID)
    monkeypatch.undo()  # restored on the class: the lifecycle bound after still has the patch
    (c,) = bound_after.orders("c")
    c.pay()
    assert c.state is S.PAID


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Basket(Tracked):
    """Order's guards, on a class no table is built for."""

    def paid_in_full(self) -> bool:
        return True

    def ready(self) -> bool:
        return False


def test_a_misspelt_guard_is_refused_before_anything_fires_with_one_message() -> None:
    misspelt = edges(pay_guard="paid_in_ful")
    with pytest.raises(InvalidTable) as at_definition:
        table(Basket, edges=misspelt)
    # Without record=, the class is checked when a lifecycle first admits one of its records.
    unbound = table(None, edges=misspelt)
    lc: Lifecycle[Basket] = Lifecycle(
        unbound, {"charge": print, "release": print, "notify": print})
    with pytest.raises(InvalidTable) as at_admission:
        lc.admit(Basket("a"))
    with pytest.raises(InvalidTable) as at_construction:
        Lifecycle(unbound, {"charge": print, "release": print, "notify": print}, record=Basket)
    assert str(at_definition.value) == str(at_admission.value) == str(at_construction.value) == (
        "shop: guard 'paid_in_ful' of event 'pay' is not a method of Basket "
        "(did you mean 'paid_in_full'?)"
    )
    assert len(lc) == 0


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Odd(Tracked):
    def paid_in_full(self, event: Firing, extra: int) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "shop: guard 'paid_in_full' of event 'pay': Odd.paid_in_full must take (self) or "
             "(self, event)"),
        ({"edges": edges(pay_guard="ready")},
         "Odd.ready is a property, not a method: write def ready(self)"),
    ],
)
def test_guards_of_the_wrong_shape_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTable, match=re.escape(message)):
        table(Odd, **overrides)


def test_hooks_are_checked_when_the_lifecycle_is_built() -> None:
    hooks: dict[str, Any] = {"charge": print, "release": print, "notify": print}
    with pytest.raises(MissingHook, match=r"not supplied: \['notify'\]"):
        Lifecycle(TABLE, {k: v for k, v in hooks.items() if k != "notify"})
    with pytest.raises(MissingHook, match=r"does not name: \['relaese'\]"):
        Lifecycle(TABLE, {**hooks, "relaese": print})
    with pytest.raises(MissingHook, match=r"hook 'notify' must take \(req\) or \(req, event\)"):
        Lifecycle(TABLE, {**hooks, "notify": lambda a, b, c: None})


def test_trigger_methods_come_from_the_table() -> None:
    for event in E:
        method = getattr(Order, event.value)
        assert callable(method) and method.__name__ == event.value
    shop = Shop()
    (a,) = shop.orders("a", paid=10)
    a.pay()
    a.cancel("changed my mind")  # a detail without a reason is kept
    assert (a.state, a.reason, a.detail) == (S.CANCELLED, None, "changed my mind")
    with pytest.raises(TypeError, match="pass the reason by keyword"):
        shop.orders("b")[0].fail(Why.DECLINED)  # type: ignore[arg-type]


@pytest.mark.parametrize("when", ["lifecycle", "admission"])
def test_a_table_without_a_record_gives_triggers_to_the_class_it_is_bound_to(when: str) -> None:
    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Unbound(Tracked):
        def paid_in_full(self) -> bool:
            return True

        def ready(self) -> bool:
            return False

    plain = table()  # no record=
    assert not hasattr(Unbound, "pay")
    lc: Lifecycle[Unbound] = Lifecycle(
        plain, dict.fromkeys(("charge", "release", "notify"), lambda u: None),
        record=Unbound if when == "lifecycle" else None)
    assert hasattr(Unbound, "pay") == (when == "lifecycle")
    u = Unbound("u")
    lc.admit(u)
    u.pay()  # type: ignore[attr-defined]
    u.finish()  # type: ignore[attr-defined]
    assert u.state is S.DONE


def test_plain_event_names_are_the_edges_not_a_list() -> None:
    with pytest.raises(InvalidTable, match=r"events must be an enum\.StrEnum class, got "
                       r"\['pay'\]; to use plain names, leave events out"):
        table(Order, events=["pay"])


def test_an_event_may_not_be_a_special_method_name() -> None:
    with pytest.raises(InvalidTable, match=r"event '__init__' is a special method name"):
        make_table("dunder", S, initial=S.CREATED, finals=FINALS,
                   edges=(Edge("__init__", S.CREATED, S.DONE),))


def test_an_ended_record_pickles_and_copies_without_its_lifecycle() -> None:
    shop = Shop()
    a, b = shop.orders("a", "b", paid=10)
    with pytest.raises(LifecycleError, match=r"a Lifecycle \(shop\) cannot be pickled or "
                       r"copied: .* pickle or copy a record once it has ended"):
        pickle.dumps(a)
    assert copy.deepcopy(a).owner is shop.lc  # a deep copy of a live record is a copy
    with pytest.raises(LifecycleError, match="is a copy of a tracked record"):
        copy.deepcopy(a).finish()  # no edge from CREATED: still named a copy
    a.pay()
    a.cancel("changed my mind")
    for kept in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.copy(a)):
        assert (kept.rid, kept.state, kept.detail, kept.paid) == (
            "a", S.CANCELLED, "changed my mind", 10)
        assert kept.timeline == a.timeline and kept.is_final
        assert kept.owner is not shop.lc and kept.owner.table == TABLE
        with pytest.raises(IllegalTransition, match="CANCELLED cannot take event 'pay'"):
            kept.pay()
        with pytest.raises(LifecycleError, match="ended in CANCELLED: a record is admitted once"):
            shop.lc.admit(kept)
    assert shop.lc.get("b") is b and len(shop.lc) == 1  # the lifecycle is as it was


def test_a_final_state_has_no_live_view() -> None:
    shop = Shop()
    with pytest.raises(LifecycleError, match=re.escape(
            "shop: DONE is a final state, and the lifecycle keeps only live requests; ended "
            "ones are counted in .finished")):
        shop.lc.in_state(S.DONE)
    assert dict(shop.lc.in_state(S.CREATED)) == {}


def test_trigger_names_are_checked_against_the_class() -> None:
    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Typo(Tracked):
        payy: ClassVar[Trigger]

        def paid_in_full(self) -> bool:
            return True

        def ready(self) -> bool:
            return True

    with pytest.raises(InvalidTable, match=re.escape(
        "Typo.payy is declared a Trigger, but the table has no event 'payy' (did you mean 'pay'?)"
    )):
        table(Typo)
    # The same declaration evaluated, as a module without ``from __future__ import
    # annotations`` leaves it, is checked too.
    Evaluated = attrs.define(slots=True, eq=False, weakref_slot=False)(type(
        "Evaluated", (Tracked,), {"__annotations__": {"payy": ClassVar[Trigger]},
                                  "paid_in_full": lambda self: True,
                                  "ready": lambda self: True}))
    with pytest.raises(InvalidTable, match=re.escape("Evaluated.payy is declared a Trigger")):
        table(Evaluated)

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Clash(Tracked):
        finish: int = 0

        def paid_in_full(self) -> bool:
            return True

        def ready(self) -> bool:
            return True

    with pytest.raises(InvalidTable, match=r"Clash\.finish is a field of the record, and "
                       r"event 'finish' makes a trigger method of that name; rename one"):
        table(Clash)

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class MethodClash(Tracked):
        def finish(self) -> None: ...

        def paid_in_full(self) -> bool:
            return True

        def ready(self) -> bool:
            return True

    with pytest.raises(InvalidTable, match=r"MethodClash\.finish already exists \(a method\)"):
        table(MethodClash)


def test_events_are_an_enum_per_table() -> None:
    assert TABLE.event_type is E and TABLE.events == tuple(E)
    plain = table(Order, edges=tuple(attrs.evolve(e, event=str(e.event)) for e in edges()))
    assert all(isinstance(e.event, E) for e in plain.edges)  # names looked up in the enum
    assert plain.edge(S.CREATED, "pay") is plain.edge(S.CREATED, E.PAY)
    with pytest.raises(InvalidTable, match="edge event 'payy' is not a member of E"):
        table(Order, edges=(Edge("payy", S.CREATED, S.PAID), *edges()[1:]))
    with pytest.raises(InvalidTable, match=r"E has events no edge takes: \['finish'\]"):
        kept = tuple(e for e in edges() if e.event is not E.FINISH)
        table(Order, edges=(*kept, Edge(E.PAY, S.PAID, S.DONE)))
    shop = Shop()
    (a,) = shop.orders("a")
    with pytest.raises(IllegalTransition) as info:
        shop.lc.fire("finsh", [a])
    assert str(info.value) == (
        "request 'a' in state CREATED cannot take event 'finsh': table 'shop' has no such "
        "event (did you mean 'finish'?); its events: pay, finish, cancel, fail"
    )
    # refusal() raises the same, rather than answering a reason a filter would drop everyone
    # for: [r for r in batch if not lc.refusal(r, "finsh")] is a mistake, not an empty batch.
    with pytest.raises(IllegalTransition) as asked:
        shop.lc.refusal(a, "finsh")
    assert str(asked.value) == str(info.value)
    assert shop.lc.refusal(a, "finish") == "CREATED has no 'finish' edge"


def test_reasons_belong_to_the_table_and_only_end_requests() -> None:
    shop = Shop()
    a, b = shop.orders("a", "b", paid=10)

    class Other(enum.Enum):
        X = 1

    with pytest.raises(LifecycleError, match=re.escape("reason <Other.X: 1> is not a Why")):
        shop.lc.fire(E.FAIL, [a], reason=Other.X)
    with pytest.raises(LifecycleError, match="'pay' leads to PAID, not a final state"):
        shop.lc.fire(E.PAY, [a], detail="early")
    assert a.state is S.CREATED and not shop.calls
    shop.lc.fire(E.FAIL, [a, b], reason=Why.DECLINED, detail="card expired")
    assert shop.lc.finished == {(S.FAILED, Why.DECLINED): 2}
    assert (a.reason, a.detail) == (Why.DECLINED, "card expired")


def test_once_hooks_default_to_the_final_states_hooks() -> None:
    assert TABLE.once == {"release", "notify"}
    assert table(Order, once=("release",)).once == {"release"}
    with pytest.raises(InvalidTable, match=r"once names hooks the table does not run: \['x'\]"):
        table(Order, once=("x",))


def test_a_raising_hook_never_splits_a_batch() -> None:
    # The batch path: all three move, every hook of every one runs, the error is reported.
    batch_shop = Shop(raising="y")
    x, y, z = batch_shop.orders("x", "y", "z")
    with pytest.raises(HookFailed) as info:
        batch_shop.lc.fire(E.CANCEL, [x, y, z])
    assert [o.state for o in (x, y, z)] == [S.CANCELLED] * 3
    assert len(batch_shop.lc) == 0
    assert [(h, rid) for h, rid, _ in batch_shop.calls] == [
        ("release", "x"), ("notify", "x"), ("release", "y"), ("notify", "y"),
        ("release", "z"), ("notify", "z"),
    ]
    assert [(rid, hook) for rid, hook, _ in info.value.errors] == [("y", "release")]
    assert isinstance(info.value.__cause__, RuntimeError)
    assert str(info.value) == (
        "hook 'release' raised for request 'y'; event 'cancel' took effect: every request it "
        "was fired for is in CANCELLED. The error: RuntimeError: the warehouse is closed"
    )
    # Several errors: the message counts the others as errors (one request may raise twice).
    errors = [("y", "release", RuntimeError("a")), ("y", "notify", RuntimeError("b")),
              ("z", "release", RuntimeError("c"))]
    assert "for request 'y' (and 2 more hook errors); event" in str(
        HookFailed("cancel", S.CANCELLED, errors))
    assert "(and 1 more hook error);" in str(HookFailed("cancel", S.CANCELLED, errors[:2]))
    assert str(HookFailed("cancel", S.CANCELLED, errors)).endswith(
        "is in CANCELLED. The first error: RuntimeError: a")
    # The trigger path leaves the same state.
    one_shop = Shop(raising="y")
    (y1,) = one_shop.orders("y")
    with pytest.raises(HookFailed):
        y1.cancel()
    assert y1.state is S.CANCELLED and len(one_shop.lc) == 0
    assert one_shop.calls == [c for c in batch_shop.calls if c[1] == "y"]
    assert one_shop.lc.finished == {(S.CANCELLED, None): 1}


calls: list[str] = []


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Counted(Tracked):
    """Counts its guard's evaluations outside the record (the record does not change)."""

    def paid_in_full(self) -> bool:
        calls.append(self.rid)
        return self.rid != "b"

    def ready(self) -> bool:
        return False


@pytest.mark.parametrize("one_by_one", [True, False], ids=["trigger", "batch"])
def test_a_refusal_comes_from_the_one_evaluation(one_by_one: bool) -> None:
    tbl = table(Counted)
    lc: Lifecycle[Counted] = Lifecycle(tbl, {"charge": print, "release": print, "notify": print})
    a, b = Counted("a"), Counted("b")
    lc.admit(a)
    lc.admit(b)
    calls.clear()
    with pytest.raises(GuardFailed, match="paid_in_full is false"):
        if one_by_one:
            b.fire(E.PAY)
        else:
            lc.fire(E.PAY, [a, b])
    assert calls == (["b"] if one_by_one else ["a", "b"])
    assert lc.guards_evaluated == len(calls)
    assert a.state is b.state is S.CREATED


def test_perfetto_names_the_process_after_the_table() -> None:
    shop = Shop()
    (a,) = shop.orders("a")
    a.cancel()
    trace = to_perfetto([a])
    assert trace["traceEvents"][0] == {
        "ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "shop"},
    }
    assert to_perfetto([a], process="orders")["traceEvents"][0]["args"]["name"] == "orders"


def test_mypy_sees_declared_trigger_methods_and_event_enums(tmp_path: Path) -> None:
    from mypy import api

    probe = tmp_path / "probe.py"
    probe.write_text(
        "from examples.orders import Order, OrderEvent\n"
        "order = Order('a')\n"
        "order.pay()\n"
        "order.cancel('changed my mind')\n"
        "order.fire(OrderEvent.SHIP)\n"
        "order.shp()\n"
        "order.fire(OrderEvent.SHP)\n"
    )
    out, _err, status = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(probe)])
    assert status == 1
    errors = [line.split(": error: ")[1] for line in out.splitlines() if ": error: " in line]
    assert errors == [
        '"Order" has no attribute "shp"; maybe "ship"?  [attr-defined]',
        '"type[OrderEvent]" has no attribute "SHP"  [attr-defined]',
    ]


def test_an_event_python_would_spell_otherwise_is_refused() -> None:
    # "ﬁnish" (an fi ligature) is an identifier, but Python reads `req.ﬁnish()` as `req.finish()`.
    ligature = "\ufb01nish"
    assert ligature.isidentifier()
    with pytest.raises(InvalidTable, match=re.escape(
            f"event '{ligature}' is not its own NFKC form 'finish': Python normalises "
            f"identifiers, so req.{ligature}() would call finish")):
        table(events=None, edges=(*edges(), Edge(ligature, S.CREATED, S.DONE)))
    # Letters that are their own NFKC form are names like any other.
    fine = table(events=None, edges=(*edges(), Edge("veröffentlichen", S.CREATED, S.DONE)))
    assert "veröffentlichen" in fine.events


def test_a_record_of_another_class_is_refused_at_admission_naming_the_class() -> None:
    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Parcel(Tracked):  # a record of another table: it has none of this table's guards
        pass

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class RushOrder(Order):
        pass

    shop = Shop()
    with pytest.raises(TypeError, match=re.escape(
            "shop: request 'p' is of class Parcel, and this lifecycle tracks records of class "
            "Order (the table's or the lifecycle's record=) or its subclasses")):
        shop.lc.admit(Parcel("p"))  # type: ignore[arg-type]
    for thing in ("a", None, Firing("pay", S.CREATED, S.PAID)):
        with pytest.raises(TypeError, match=r"^shop: admit\(\) takes a record, an instance of "
                           r"a subclass of lifecycle\.Tracked, got "):
            shop.lc.admit(thing)  # type: ignore[arg-type]
    assert len(shop.lc) == 0 and "p" not in shop.lc
    shop.lc.admit(RushOrder("r", paid=10))  # a subclass is one
    shop.lc.get("r").pay()  # type: ignore[union-attr]
    # A table without record= takes the class the lifecycle names.
    hooks = dict.fromkeys(("charge", "release", "notify"), lambda o: None)
    named: Lifecycle[Order] = Lifecycle(table(), hooks, record=Order)
    with pytest.raises(TypeError, match="request 'q' is of class Parcel"):
        named.admit(Parcel("q"))  # type: ignore[arg-type]


def _recording(calls: list[tuple[str, str]]) -> dict[str, Any]:
    """The shop's hooks, each recording (its name, the request id) in ``calls``."""
    return {name: functools.partial(lambda n, o: calls.append((n, o.rid)), name)
            for name in ("charge", "release", "notify")}


def test_a_record_of_a_class_another_table_was_built_for_is_refused_unless_told() -> None:
    """Order is the record class table 'shop' was built for (record=Order). A lifecycle of
    table 'till', built without record= and given none, would fire an Order with the till's
    guards and hooks: admission refuses it, naming both tables and what to do, and changes
    nothing (a subclass of Order alike). Told, with record= on the lifecycle or on the table,
    it tracks Orders, each lifecycle by its own table's guards and its own hooks."""
    # The till finishes only an order not paid in full: another guard than the shop's.
    till = table(name="till", edges=edges(finish_guard="paid_in_full"))

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class RushOrder(Order):
        pass

    untold: Lifecycle[Order] = Lifecycle(till, _recording([]))
    for order in (Order("a"), RushOrder("a"), Order("a")):  # refused again: nothing was kept
        kind = type(order).__name__
        with pytest.raises(TypeError, match="^" + re.escape(
                f"till: request 'a' is of class {kind}, which table 'shop' (record=Order) was "
                f"built for, and neither this lifecycle nor its table 'till' names a record "
                f"class, so its guards and hooks would be this table's: admit it to a "
                f"lifecycle of the table it was built for, or, to track {kind} records by "
                f"table 'till' too, pass record={kind} to this Lifecycle or to its table's "
                f"make_table") + "$"):
            untold.admit(order)
        assert (order.owner, order.state, order.timeline) == (None, None, [])
    assert len(untold) == 0 and untold.counts() == {S.CREATED: 0, S.PAID: 0}
    # Another table of the same name is named as another.
    with pytest.raises(TypeError, match=re.escape(
            "shop: request 'b' is of class Order, which another table named 'shop' "
            "(record=Order) was built for")):
        Lifecycle(table(), _recording([])).admit(Order("b"))

    shop_calls: list[tuple[str, str]] = []
    till_calls: list[tuple[str, str]] = []
    shop: Lifecycle[Order] = Lifecycle(TABLE, _recording(shop_calls))
    told: Lifecycle[Order] = Lifecycle(till, _recording(till_calls), record=Order)
    a, b = Order("a", paid=10), Order("b", paid=10)
    shop.admit(a)
    told.admit(b)
    a.pay()
    b.pay()
    a.finish()  # the shop's guard: unless ready, which is false
    with pytest.raises(GuardFailed, match="paid_in_full is true"):
        b.finish()  # the till's guard
    assert (a.state, b.state) == (S.DONE, S.PAID)
    assert shop_calls == [("charge", "a"), ("release", "a"), ("notify", "a")]
    assert till_calls == [("charge", "b")]
    # A table built for Order too (the class bound to two tables) admits it without being told.
    also: Lifecycle[Order] = Lifecycle(table(Order, name="till"), _recording([]))
    also.admit(c := Order("c"))
    assert c.state is S.CREATED and c.owner is also


def test_a_misspelt_hook_gets_the_name_it_was_meant_for() -> None:
    hooks: dict[str, Any] = {"charge": print, "release": print, "notify": print}
    with pytest.raises(MissingHook, match=re.escape(
            "shop: the table names hooks not supplied: ['notify'] (did you mean 'notify' where "
            "you gave 'notfy'?)")):
        Lifecycle(TABLE, {"charge": print, "release": print, "notfy": print})
    with pytest.raises(MissingHook, match=re.escape(
            "does not name: ['relaese'] (did you mean 'release' where you gave 'relaese'?)")):
        Lifecycle(TABLE, {**hooks, "relaese": print})
    with pytest.raises(MissingHook, match=r"does not name: \['audit'\]$"):
        Lifecycle(TABLE, {**hooks, "audit": print})  # nothing like it: no guess


def test_records_of_two_tables_declare_each_tables_triggers_on_a_subclass() -> None:
    class Q(enum.IntEnum):
        DONE = 0
        QUEUED = 1

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Shared(Tracked):  # fields and guards both tables use, no Trigger declarations
        def paid_in_full(self) -> bool:
            return True

        def ready(self) -> bool:
            return False

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class ShopOrder(Shared):
        pay: ClassVar[Trigger]
        cancel: ClassVar[Trigger]

    @attrs.define(slots=True, eq=False, weakref_slot=False)
    class Reindex(Shared):
        start: ClassVar[Trigger]

    def reindex(record: type) -> LifecycleTable:
        return make_table("reindex", Q, initial=Q.QUEUED, finals=(Q.DONE,),
                          edges=(Edge("start", Q.QUEUED, Q.DONE), Edge("scan", Q.QUEUED, Q.DONE)),
                          record=record)

    # The shop's declarations on the class the reindex table is given: refused, saying how to
    # share, and without a guess from another word ('scan' is not 'cancel').
    with pytest.raises(InvalidTable, match=re.escape(
            "reindex: ShopOrder.cancel is declared a Trigger, but the table has no event "
            "'cancel'; declare the table's events only (records of two tables declare each "
            "table's triggers on a subclass of their own)")):
        reindex(ShopOrder)
    shop_table, reindex_table = table(ShopOrder), reindex(Reindex)
    shop: Lifecycle[ShopOrder] = Lifecycle(
        shop_table, dict.fromkeys(("charge", "release", "notify"), lambda o: None))
    jobs: Lifecycle[Reindex] = Lifecycle(reindex_table)
    o, j = ShopOrder("o"), Reindex("j")
    shop.admit(o)
    jobs.admit(j)
    o.pay()
    j.start()
    assert (o.state, j.state) == (S.PAID, Q.DONE)
    assert not hasattr(Reindex, "pay") and not hasattr(ShopOrder, "start")
