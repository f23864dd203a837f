"""A lifecycle of your own: shop orders, end to end (docs/framework.md walks through it).

    CREATED --pay--> PAID --ship--> SHIPPED --deliver--> DELIVERED
    any live state --cancel--> CANCELLED, --fail--> FAILED

Run it: ``python examples/orders.py``. It validates the table, places orders, fires events
one by one and in batches (a guard refuses one), cancels and fails orders with and without a
reason, prints the timelines, the trace size and the diagram, and ends with ``ok``. The same
module is what ``pdlife validate|diagram|fuzz --load examples.orders:ORDER_TABLE`` reads.
"""

from __future__ import annotations

import enum
import sys
from typing import ClassVar

import attrs

from lifecycle import (
    Edge,
    Firing,
    GuardFailed,
    Lifecycle,
    LifecycleTable,
    Tracked,
    Trigger,
    make_table,
    validate,
)
from lifecycle.diagram import mermaid
from lifecycle.timeline import records, to_perfetto


class OrderState(enum.IntEnum):
    FAILED = 0
    CANCELLED = 1
    CREATED = 2
    PAID = 3
    SHIPPED = 4
    DELIVERED = 5


class OrderEvent(enum.StrEnum):
    PAY = "pay"
    SHIP = "ship"
    DELIVER = "deliver"
    CANCEL = "cancel"
    FAIL = "fail"


class OrderFailure(enum.Enum):
    PAYMENT_DECLINED = "payment_declined"
    OUT_OF_STOCK = "out_of_stock"
    LOST_IN_TRANSIT = "lost_in_transit"


@attrs.define(slots=True, eq=False, weakref_slot=False)
class Order(Tracked):
    """An order: what it costs, what was paid, where it goes, and the stock it holds."""

    total: int = attrs.field(default=0, kw_only=True)  # cents
    paid: int = attrs.field(default=0, kw_only=True)
    address: str = attrs.field(default="", kw_only=True)
    held: int = attrs.field(default=1, kw_only=True)  # units reserved in the warehouse
    reason: OrderFailure | None = attrs.field(default=None, kw_only=True)

    # Optional: lets mypy see the trigger methods the table makes (each is checked against it).
    pay: ClassVar[Trigger]
    ship: ClassVar[Trigger]
    deliver: ClassVar[Trigger]
    cancel: ClassVar[Trigger]
    fail: ClassVar[Trigger]

    def paid_in_full(self) -> bool:
        return self.paid >= self.total

    def has_address(self, event: Firing) -> bool:
        # The second form of a guard: it is told what is being fired.
        assert event.dest is OrderState.SHIPPED
        return bool(self.address)


S, E = OrderState, OrderEvent
LIVE = (S.CREATED, S.PAID, S.SHIPPED)


def _refund_if_paid(state: OrderState) -> tuple[str, ...]:
    return ("refund",) if state is not S.CREATED else ()


ORDER_TABLE = make_table(
    "order",
    OrderState,
    events=OrderEvent,
    initial=S.CREATED,
    finals=(S.DELIVERED, S.CANCELLED, S.FAILED),
    edges=(
        Edge(E.PAY, S.CREATED, S.PAID, conditions="paid_in_full",
             doc="the payment covers the total"),
        Edge(E.SHIP, S.PAID, S.SHIPPED, conditions="has_address",
             doc="handed to the carrier"),
        Edge(E.DELIVER, S.SHIPPED, S.DELIVERED, doc="the carrier confirmed delivery"),
        *(Edge(E.CANCEL, s, S.CANCELLED, after=_refund_if_paid(s),
               doc="the customer cancelled") for s in LIVE),
        *(Edge(E.FAIL, s, S.FAILED, after=_refund_if_paid(s),
               doc="payment declined, out of stock, lost in transit") for s in LIVE),
    ),
    failure_events=(E.CANCEL, E.FAIL),
    on_enter={final: ("release", "notify") for final in (S.DELIVERED, S.CANCELLED, S.FAILED)},
    reasons=OrderFailure,
    record=Order,
)


class Shop:
    """The owner of the orders: it supplies the hooks the table names."""

    def __init__(self, stock: int) -> None:
        self.stock = stock
        self.outbox: list[str] = []
        self.refunds: list[str] = []
        self.orders: Lifecycle[Order] = Lifecycle(
            ORDER_TABLE, {"release": self.release, "notify": self.notify, "refund": self.refund}
        )

    def place(self, rid: str, total: int, address: str = "") -> Order:
        self.stock -= 1
        order = Order(rid, total=total, address=address)
        self.orders.admit(order)
        return order

    def release(self, order: Order) -> None:
        """Give the order's stock reservation up (a delivered unit has left the warehouse)."""
        if not order.held:
            raise RuntimeError(f"order {order.rid} released its stock twice")
        if order.state is not S.DELIVERED:
            self.stock += order.held
        order.held = 0

    def notify(self, order: Order, event: Firing) -> None:
        why = f" ({order.detail})" if order.detail else ""
        self.outbox.append(f"{order.rid}: {event.dest.name.lower()} after {event.event}{why}")

    def refund(self, order: Order) -> None:
        self.refunds.append(order.rid)


# -- for the fuzzer (tests/test_example_orders.py, pdlife fuzz --satisfy) ----------------------


def satisfy(order: Order, edge: Edge) -> None:
    """Make ``edge``'s guards hold for ``order``."""
    if edge.event == E.PAY:
        order.paid = order.total
    elif edge.event == E.SHIP:
        order.address = "1 Main St"


def holds_nothing_once_ended(order: Order) -> bool:
    """An invariant of the embedder: an ended order holds no stock."""
    return not order.is_final or order.held == 0


# -- the walk-through -------------------------------------------------------------------------


def describe(table: LifecycleTable) -> None:
    validate(table)
    print(f"table {table.name}: {len(table.states)} states, {len(table.edges)} edges, "
          f"events {', '.join(table.events)}; valid")


def main() -> int:
    describe(ORDER_TABLE)
    shop = Shop(stock=10)
    a = shop.place("a", total=30, address="1 Main St")
    b = shop.place("b", total=20, address="2 High St")
    c = shop.place("c", total=20)
    d = shop.place("d", total=50)

    try:
        a.pay()  # nothing paid yet: the guard refuses, nothing changes
    except GuardFailed as exc:
        print(f"refused: {exc}")
    for order in (a, b, c):
        order.paid = order.total
    a.pay()  # one by one
    shop.orders.fire(E.PAY, [b, c])  # a batch of orders in one state
    try:
        shop.orders.fire(E.SHIP, [a, b, c])  # c has no address: the whole batch is refused
    except GuardFailed as exc:
        print(f"refused: {exc}")
    shop.orders.fire(E.SHIP, [a, b])
    a.deliver()
    b.fail("the van was stolen", reason=OrderFailure.LOST_IN_TRANSIT)
    c.cancel("customer changed mind")  # a detail without a reason is kept
    shop.orders.fail([d], OrderFailure.PAYMENT_DECLINED, "card expired", event=E.FAIL)

    for order in (a, b, c, d):
        steps = " -> ".join(f"{r.event}:{r.dest.name}" for r in records(order))
        reason = order.reason.value if order.reason else "-"
        assert order.state is not None  # admitted
        print(f"{order.rid}: {order.state.name:9} reason={reason} detail={order.detail!r} "
              f"[{steps}]")
    print("outbox:", "; ".join(shop.outbox))
    print(f"refunds: {', '.join(shop.refunds)}; stock {shop.stock} of 10")
    finished = shop.orders.finished.items()
    print("finished:", {f"{s.name}/{r.value if r else '-'}": n for (s, r), n in finished})
    trace = to_perfetto([a, b, c, d])
    process = trace["traceEvents"][0]["args"]["name"]
    print(f"perfetto trace: {len(trace['traceEvents'])} events, process {process!r}")
    print(mermaid(ORDER_TABLE, collapse_failures=True), end="")
    assert shop.stock == 9 and len(shop.orders) == 0
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
