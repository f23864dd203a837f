"""Cost of a request's lifecycle: pdlife against the ways ``transitions`` is usually used.

Every variant runs the prefill happy path, BOOTSTRAPPING → bootstrapped → schedule → prefilled
(guarded by ``fully_computed``; ``computed`` is set first) → transferred → DONE, for the same
number of requests, in one run:

  a) one ``transitions.Machine`` per request, as the transitions README shows
  b) one shared Machine, ``add_model`` per request (``auto_transitions=False``), ``remove_model``
     when done
  c) pdlife, one request at a time through its trigger methods (``req.bootstrapped()`` ...)
  d) pdlife, ``Lifecycle.fire`` on batches of 64 requests that share a state
  e) a plain ``{(state, event): dest}`` dict moving a plain slotted record that holds the same
     request data as pdlife's (the floor: every field of ``PrefillRequest`` but the two the
     lifecycle keeps for itself, its timeline and owner; a two-argument ``__init__`` that
     stores the defaults; no guards checked through a library, no index, no timeline, no
     admission, no hooks)
  f) the same dict moving pdlife's own record (``PrefillRequest``): what of (d) is building the
     record rather than running its lifecycle
  g) the same dict moving a four-field record (id, prompt, progress, state): the floor issue 17
     first measured against, which holds less than a prefill request must (docs/benchmarks.md)
  h) (d) with 64 other requests waiting in each live state all along, so that no batch is the
     whole of its state's collection (as when some requests of a forward batch need more
     chunks): the batch path checking and moving request by request

It prints microseconds per request lifecycle (best of ``--repeats`` rounds, each running every
variant once, in an order reversed every other round; ``--clock cpu`` reads this
process's CPU time, which other work on a shared machine moves less than wall time) and bytes
allocated per request by creating it and running its lifecycle (tracemalloc; the prompt is
shared and not counted), then ``RESULT lifecycle ratio=<a/d> us_per_request=<d>
bytes_per_request=<d> one_by_one_us=<c> floor_ratio=<d/e> bare_floor_ratio=<d/g>
part_bucket_floor_ratio=<h/e>``.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
from transitions import Machine
from transitions.core import EventData

from lifecycle import (
    PREFILL_TABLE,
    Lifecycle,
    PrefillEvent,
    PrefillRequest,
    PrefillState,
    shared_machine,
)
from lifecycle.prefill import DEFAULT_SAMPLING

PROMPT = list(range(256))
BATCH = 64
STATES = ["bootstrapping", "waiting", "forward", "transferring", "done", "failed"]
TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "bootstrapped", "source": "bootstrapping", "dest": "waiting"},
    {"trigger": "schedule", "source": "waiting", "dest": "forward"},
    {"trigger": "prefilled", "source": "forward", "dest": "transferring",
     "conditions": "fully_computed"},
    {"trigger": "transferred", "source": "transferring", "dest": "done"},
]


class PlainModel:
    """The request record the transitions variants drive (it gets the trigger methods)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.input_ids = PROMPT
        self.computed = 0

    def fully_computed(self) -> bool:
        return self.computed >= len(self.input_ids)


def machine_per_request(n: int) -> list[Any]:
    out = []
    for i in range(n):
        m: Any = PlainModel(f"r{i}")
        Machine(model=m, states=STATES, transitions=TRANSITIONS, initial="bootstrapping")
        m.bootstrapped()
        m.schedule()
        m.computed = len(m.input_ids)
        m.prefilled()
        m.transferred()
        out.append(m)
    return out


def shared_add_model(n: int) -> list[Any]:
    machine = Machine(
        model=None, states=STATES, transitions=TRANSITIONS, initial="bootstrapping",
        auto_transitions=False,
    )
    out = []
    for i in range(n):
        m: Any = PlainModel(f"r{i}")
        machine.add_model(m)
        m.bootstrapped()
        m.schedule()
        m.computed = len(m.input_ids)
        m.prefilled()
        m.transferred()
        out.append(m)
    # Done requests must leave the machine, or its model list grows without bound.
    for m in out:
        machine.remove_model(m)
    return out


def _lifecycle() -> Lifecycle[PrefillRequest]:
    def noop(_req: PrefillRequest) -> None:
        return None

    return Lifecycle(PREFILL_TABLE, {"release": noop, "respond": noop})


def pdlife_one_by_one(n: int) -> list[Any]:
    lc = _lifecycle()
    out = []
    for i in range(n):
        r: Any = PrefillRequest(f"r{i}", input_ids=PROMPT)  # its triggers are made at run time
        lc.admit(r)
        r.bootstrapped()
        r.schedule()
        r.computed = len(r.input_ids)
        r.prefilled()
        r.transferred()
        out.append(r)
    return out


def pdlife_batched(n: int, *, parked: bool = False) -> list[Any]:
    """(d); with ``parked``, (h): 64 other requests wait in each live state all along, so no
    batch is the whole of its state's bucket and every check and move is request by request."""
    lc = _lifecycle()
    out: list[Any] = []
    fire = lc.fire
    if parked:
        _park(lc)
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        batch = [PrefillRequest(f"r{i}", input_ids=PROMPT) for i in range(start, stop)]
        for r in batch:
            lc.admit(r)
        fire(PrefillEvent.BOOTSTRAPPED, batch)
        fire(PrefillEvent.SCHEDULE, batch)
        for r in batch:
            r.computed = len(r.input_ids)
        fire(PrefillEvent.PREFILLED, batch)
        fire(PrefillEvent.TRANSFERRED, batch)
        out.extend(batch)
    return out


def _park(lc: Lifecycle[PrefillRequest]) -> None:
    """Leave ``BATCH`` requests in each live state: ``4 * BATCH`` admitted, then all but the
    first ``BATCH`` bootstrapped, all but the first two ``BATCH`` scheduled, the last prefilled."""
    park = [
        PrefillRequest(f"p{i}", input_ids=PROMPT, computed=len(PROMPT)) for i in range(4 * BATCH)
    ]
    for r in park:
        lc.admit(r)
    for k, event in enumerate((PrefillEvent.BOOTSTRAPPED, PrefillEvent.SCHEDULE,
                               PrefillEvent.PREFILLED), start=1):
        lc.fire(event, park[k * BATCH:])


# The dict variants move pdlife's own state values, so (f)'s record holds a state of its type.
S = PrefillState


DICT_TABLE = {
    (S.BOOTSTRAPPING, "bootstrapped"): S.WAITING,
    (S.WAITING, "schedule"): S.FORWARD,
    (S.FORWARD, "prefilled"): S.TRANSFERRING,
    (S.TRANSFERRING, "transferred"): S.DONE,
}


class DictRequest:
    """(g)'s record: four fields, less than a prefill request holds."""

    __slots__ = ("computed", "input_ids", "rid", "state")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.input_ids = PROMPT
        self.computed = 0
        self.state = S.BOOTSTRAPPING


def _dict_lifecycles(n: int, make: Callable[[str], Any]) -> list[Any]:
    table = DICT_TABLE
    out = []
    for i in range(n):
        r = make(f"r{i}")
        r.state = table[(r.state, "bootstrapped")]
        r.state = table[(r.state, "schedule")]
        r.computed = len(r.input_ids)
        if r.computed >= len(r.input_ids):
            r.state = table[(r.state, "prefilled")]
        r.state = table[(r.state, "transferred")]
        out.append(r)
    return out


class FloorRequest:
    """(e)'s record: a prefill request's data (every field of ``PrefillRequest`` but the
    lifecycle's own timeline and owner) in a plain slotted class, built as cheaply as Python
    builds such an object: two arguments, the defaults stored as constants."""

    __slots__ = (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "cached", "computed", "deadline",
        "detail", "first_token", "input_ids", "on_device", "pages", "pending_abort", "prefix",
        "reason", "rid", "sampling", "scheduled", "sender", "sent", "slot", "state", "state_slot",
    )

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.state = S.BOOTSTRAPPING
        self.reason = None
        self.detail = ""
        self.input_ids = PROMPT
        self.bootstrap_host = ""
        self.bootstrap_port = 0
        self.bootstrap_room = 0
        self.sampling = DEFAULT_SAMPLING
        self.scheduled = 0
        self.computed = 0
        self.sent = 0
        self.pages: list[int] = []
        self.slot = None
        self.sender = None
        self.deadline = None
        self.first_token = None
        self.pending_abort = None
        self.on_device = 0
        self.cached = 0
        self.prefix = None
        self.state_slot = None


#: What the floor's record leaves out of pdlife's: what the lifecycle keeps for itself.
LIFECYCLE_FIELDS = frozenset({"timeline", "owner"})


def check_floor_fields() -> None:
    """Raise if (e)'s record no longer holds the request data pdlife's record holds."""
    want = {f.name for f in attrs.fields(PrefillRequest)} - LIFECYCLE_FIELDS
    if set(FloorRequest.__slots__) != want:
        raise RuntimeError(
            f"bench.lifecycle: the floor's record must hold PrefillRequest's request data; "
            f"missing {sorted(want - set(FloorRequest.__slots__))}, "
            f"extra {sorted(set(FloorRequest.__slots__) - want)}"
        )


def plain_dict(n: int) -> list[Any]:
    return _dict_lifecycles(n, FloorRequest)


def plain_dict_bare(n: int) -> list[Any]:
    return _dict_lifecycles(n, DictRequest)


def plain_dict_pdlife_record(n: int) -> list[Any]:
    return _dict_lifecycles(n, partial(PrefillRequest, input_ids=PROMPT, state=S.BOOTSTRAPPING))


VARIANTS: dict[str, Callable[[int], list[Any]]] = {
    "a) Machine per request": machine_per_request,
    "b) shared Machine + add_model": shared_add_model,
    "c) pdlife one by one": pdlife_one_by_one,
    "d) pdlife fire, batches of 64": pdlife_batched,
    "e) plain dict, same data (floor)": plain_dict,
    "f) plain dict, pdlife's record": plain_dict_pdlife_record,
    "g) plain dict, 4-field record": plain_dict_bare,
    "h) as d), part of each bucket": partial(pdlife_batched, parked=True),
}

#: What the timings read: wall time (the default), or this process's CPU time.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


# -- where (c) goes (--breakdown) -----------------------------------------------------------

HAPPY_PATH = (
    (PrefillEvent.BOOTSTRAPPED, PrefillState.BOOTSTRAPPING),
    (PrefillEvent.SCHEDULE, PrefillState.WAITING),
    (PrefillEvent.PREFILLED, PrefillState.FORWARD),
    (PrefillEvent.TRANSFERRED, PrefillState.TRANSFERRING),
)


def records_only(n: int) -> list[Any]:
    return [PrefillRequest(f"r{i}", input_ids=PROMPT) for i in range(n)]


def records_admitted(n: int) -> list[Any]:
    lc = _lifecycle()
    out = []
    for i in range(n):
        r = PrefillRequest(f"r{i}", input_ids=PROMPT)
        lc.admit(r)
        out.append(r)
    return out


def _library_path(n: int, through_event: bool) -> list[Any]:
    """The records and the four events through the shared machine alone: each edge's
    ``Transition.execute`` (what (c) calls: the table's transition, which skips the library's
    logging and empty callback loops), or ``Event.trigger`` (the library's entry)."""
    machine = shared_machine(PREFILL_TABLE)
    edges = [
        (machine.get_state(src), machine.events[ev], machine.events[ev].transitions[src.name][0])
        for ev, src in HAPPY_PATH
    ]
    out = []
    for i in range(n):
        r = PrefillRequest(f"r{i}", input_ids=PROMPT, state=PrefillState.BOOTSTRAPPING)
        for source, event, transition in edges:
            if through_event:
                event.trigger(r)
            else:
                transition.execute(EventData(source, event, machine, r, (), {}))
        out.append(r)
    return out


def breakdown(n: int, repeats: int, clock: Callable[[], float]) -> None:
    """Print where (c)'s time goes: the record, admission, the library, pdlife's own work."""
    record = best_time(records_only, n, repeats, clock)
    admitted = best_time(records_admitted, n, repeats, clock)
    library = best_time(partial(_library_path, through_event=False), n, repeats, clock)
    triggered = best_time(partial(_library_path, through_event=True), n, repeats, clock)
    whole = best_time(pdlife_one_by_one, n, repeats, clock)
    rows = {
        "the record (PrefillRequest)": record,
        "admission": admitted - record,
        "transitions: 4 x Transition.execute": library - record,
        "pdlife: checks, index, timeline, hooks": whole - (admitted - record) - library,
        "c) in all": whole,
        "(transitions through Event.trigger instead)": triggered - record,
    }
    print("where c) goes, us per request lifecycle:")
    for name, us in rows.items():
        print(f"  {name:46} {us:7.2f}")


def best_time(
    run: Callable[[int], list[Any]], n: int, repeats: int, clock: Callable[[], float]
) -> float:
    """Best time of ``repeats`` runs on ``clock``, in microseconds per request."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = clock()
        run(n)
        best = min(best, clock() - start)
    return best / n * 1e6


def interleaved_best(
    variants: dict[str, Callable[[int], list[Any]]], n: int, repeats: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Best time of each variant over ``repeats`` rounds that run every variant once, in
    microseconds per request. The order reverses every other round, so a drift in the machine's
    load reaches every variant alike (back-to-back repeats of one variant would put each in a
    different stretch of it)."""
    best = dict.fromkeys(variants, float("inf"))
    for round_ in range(repeats):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            gc.collect()
            start = clock()
            variants[name](n)
            best[name] = min(best[name], clock() - start)
    return {name: seconds / n * 1e6 for name, seconds in best.items()}


def bytes_per_request(run: Callable[[int], list[Any]], n: int) -> float:
    """Bytes still allocated per request after its lifecycle (the requests are kept alive)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = run(n)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(kept) == n
    return (after - before) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000,
                        help="request lifecycles per run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved rounds; the best of each variant counts "
                             "(default: %(default)s)")
    parser.add_argument("--memory-requests", type=int, default=2_000,
                        help="live requests whose memory is measured (default: %(default)s)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (default: wall)")
    parser.add_argument("--breakdown", action="store_true",
                        help="print where c)'s time goes (the record, admission, the "
                             "transitions library, pdlife) and exit")
    args = parser.parse_args()
    check_floor_fields()
    if args.breakdown:
        breakdown(args.requests, args.repeats, CLOCKS[args.clock])
        return

    print(f"{args.requests} request lifecycles per run, best of {args.repeats} interleaved rounds, "
          f"{args.clock} time")
    print(f"{'variant':34} {'us/request':>11} {'bytes/request':>14} {'vs d)':>8}")
    times = interleaved_best(VARIANTS, args.requests, args.repeats, CLOCKS[args.clock])
    results = {name: (times[name], bytes_per_request(run, args.memory_requests))
               for name, run in VARIANTS.items()}
    us_d, bytes_d = results["d) pdlife fire, batches of 64"]
    for name, (us, nbytes) in results.items():
        print(f"{name:34} {us:11.2f} {nbytes:14.0f} {us / us_d:7.1f}x")
    us_a = results["a) Machine per request"][0]
    us_c = results["c) pdlife one by one"][0]
    us_e = results["e) plain dict, same data (floor)"][0]
    us_g = results["g) plain dict, 4-field record"][0]
    us_h = results["h) as d), part of each bucket"][0]
    print(f"RESULT lifecycle ratio={us_a / us_d:.1f} us_per_request={us_d:.2f} "
          f"bytes_per_request={bytes_d:.0f} one_by_one_us={us_c:.2f} "
          f"floor_ratio={us_d / us_e:.2f} bare_floor_ratio={us_d / us_g:.2f} "
          f"part_bucket_floor_ratio={us_h / us_e:.2f}")


if __name__ == "__main__":
    main()
