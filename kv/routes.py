"""Who talks to whom between the ranks of a prefill server and the ranks of a decode server.

Theory of operation
-------------------
The prefill ranks are known from their registrations (:mod:`kv.rank_table`); a decode rank
describes itself the same way (:class:`DecodeRank`: its pool settings and its
:class:`~kv.rank_table.RankPlace`). A decode rank serves a room from one prefill DP replica
(:func:`dp_rank_of`: the room number modulo the prefill's DP size, as SGLang routes it) and
needs, from every pipeline stage of that replica, the KV heads it holds of that stage's layers.
Within a stage the TP arithmetic is :class:`~kv.layouts.SlicePlan`'s: the decode rank gives its
destination to the stage's ranks :meth:`~kv.layouts.SlicePlan.contacts` names, and its room is
complete once every :meth:`~kv.layouts.SlicePlan.sources` rank of every stage reported success
(:class:`PrefillRoute`).

The prefill side learns the decode rank's TP rank and size with its destination, and from the
same plan knows what it owes (:class:`SenderDuty`): which decode ranks' destinations it waits
for, which head slices go to each, and into which of the decode pool's layers its stage's
layers land. A rank with nothing to write is status-only: it still waits for its destinations,
so every rank of the stage agrees on the room, and concludes without writing.

Before any of it, :func:`pair_mismatches` compares what both sides must share (page size, KV
dtype, pool layout, head dim, model, the model's layer and head counts, MLA); a difference is
refused with both values named (:class:`IncompatibleRanksError`). The decode side holds every
layer (decode pipeline stages are not supported) and the TP sizes must divide one another.

Arithmetic only: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from kv.layouts import HeadSlice, LayoutError, SlicePlan, plan_slices
from kv.model_id import describe_model
from kv.rank_table import MODEL_FIELDS, POOL_FIELDS, RankInfo, RankPlace


class IncompatibleRanksError(ValueError):
    """A prefill rank and a decode rank that cannot exchange KV: different pool settings,
    models, or layouts no plan serves. The message names both sides' values."""


@attrs.frozen
class DecodeRank:
    """A decode rank as the pairing sees it: its pool's settings and its place."""

    page_size: int
    kv_dtype: str
    kv_layout: str
    head_dim: int
    model: str
    place: RankPlace
    model_name: str = attrs.field(default="", eq=False)

    @property
    def model_label(self) -> str:
        return describe_model(self.model_name, self.model)


def pair_mismatches(prefill: RankInfo, decode: DecodeRank) -> list[str]:
    """``"name: prefill X vs decode Y"`` for every pool setting or model the two must share
    and do not (the places are :func:`place_mismatches`)."""
    out = [f"{name}: prefill {getattr(prefill, name)} vs decode {getattr(decode, name)}"
           for name in POOL_FIELDS if getattr(prefill, name) != getattr(decode, name)]
    if prefill.model != decode.model:
        out.append(f"model: prefill {prefill.model_label} vs decode {decode.model_label}")
    return out + place_mismatches(prefill.place, decode.place)


def place_mismatches(prefill: RankPlace, decode: RankPlace) -> list[str]:
    """What two places must share (the model's KV shape) and do not, and a decode place that
    does not hold every layer."""
    out = [f"{name}: prefill {getattr(prefill, name)} vs decode {getattr(decode, name)}"
           for name in MODEL_FIELDS if getattr(prefill, name) != getattr(decode, name)]
    if decode.pp_size != 1:
        out.append(f"decode pp_size {decode.pp_size}: a decode rank must hold every layer "
                   "(decode pipeline stages are not supported)")
    return out


def _refuse(prefill_rank: int, decode: RankPlace, problems: Sequence[str]) -> None:
    if problems:
        raise IncompatibleRanksError(
            f"prefill rank {prefill_rank} and decode rank {decode.tp_rank} cannot exchange KV: "
            f"{'; '.join(problems)}")


def _plan(prefill_rank: int, prefill: RankPlace, decode: RankPlace) -> SlicePlan:
    try:
        return plan_slices(prefill.tp_layout, decode.tp_layout)
    except LayoutError as exc:
        raise IncompatibleRanksError(
            f"prefill rank {prefill_rank} and decode rank {decode.tp_rank}: {exc}") from None


def check_pair(prefill: RankInfo, decode: DecodeRank) -> SlicePlan:
    """The slice plan between ``prefill``'s TP group and ``decode``'s; raises
    :class:`IncompatibleRanksError` naming both sides' values when there is none."""
    _refuse(prefill.rank, decode.place, pair_mismatches(prefill, decode))
    return _plan(prefill.rank, prefill.place, decode.place)


def dp_rank_of(room: int, dp_size: int) -> int:
    """The prefill DP replica that serves ``room``."""
    return room % dp_size


class Placed(Protocol):
    """A prefill rank as a route names it: its number and its place."""

    @property
    def rank(self) -> int: ...

    @property
    def place(self) -> RankPlace: ...


P = TypeVar("P", bound=Placed)


@attrs.frozen
class StageRoute(Generic[P]):
    """One pipeline stage of the serving replica, seen from one decode rank."""

    stage: int
    layers: range
    #: The stage's ranks the decode rank gives its destination to.
    contacts: tuple[P, ...]
    #: The stage's ranks that write into the decode rank (a subset of ``contacts``).
    sources: tuple[P, ...]


@attrs.frozen
class PrefillRoute(Generic[P]):
    """Everything one decode rank needs to know to receive one room."""

    plan: SlicePlan
    dp_rank: int
    stages: tuple[StageRoute[P], ...]

    @property
    def contacts(self) -> tuple[P, ...]:
        """Every prefill rank, of every stage, that gets this decode rank's destination."""
        return tuple(r for s in self.stages for r in s.contacts)

    @property
    def sources(self) -> tuple[P, ...]:
        """Every prefill rank whose success the room waits for."""
        return tuple(r for s in self.stages for r in s.sources)


def route(ranks: Sequence[RankInfo], decode: DecodeRank, room: int) -> PrefillRoute[RankInfo]:
    """Whom ``decode`` contacts and waits for to receive ``room`` from the prefill server whose
    registered ranks are ``ranks`` (every one; the table of ``GET /route``); raises
    :class:`IncompatibleRanksError` when a rank's pool or place does not match ``decode``'s."""
    for info in ranks:
        _refuse(info.rank, decode.place, pair_mismatches(info, decode))
    return route_places(ranks, decode.place, room)


def route_places(ranks: Sequence[P], decode: RankPlace, room: int) -> PrefillRoute[P]:
    """:func:`route` over places alone (the caller compared the pools)."""
    if not ranks:
        raise IncompatibleRanksError("the prefill server has no ranks")
    for r in ranks:
        _refuse(r.rank, decode, place_mismatches(r.place, decode))
    plan = _plan(ranks[0].rank, ranks[0].place, decode)
    first = ranks[0].place
    dp = dp_rank_of(room, first.dp_size)
    by_place = {(r.place.pp_rank, r.place.tp_rank): r for r in ranks if r.place.dp_rank == dp}
    missing = [(s, t) for s in range(first.pp_size) for t in range(first.tp_size)
               if (s, t) not in by_place]
    if missing:
        raise IncompatibleRanksError(
            f"the prefill table lacks DP replica {dp}'s ranks at (pp_rank, tp_rank) {missing}")
    d = decode.tp_rank
    stages = tuple(
        StageRoute(
            stage=s,
            layers=by_place[(s, 0)].place.layers,
            contacts=tuple(by_place[(s, t)] for t in plan.contacts(d)),
            sources=tuple(by_place[(s, t)] for t in plan.sources(d)),
        )
        for s in range(first.pp_size)
    )
    return PrefillRoute(plan=plan, dp_rank=dp, stages=stages)


@attrs.frozen
class SenderDuty:
    """What one prefill rank owes one room, once it knows the decode TP layout."""

    plan: SlicePlan
    prefill_rank: int  # TP rank within its stage
    #: The decode pool's layers this rank's pool layers land in (its stage's layers).
    layers: range

    @property
    def destinations(self) -> tuple[int, ...]:
        """The decode TP ranks whose destination this rank waits for."""
        return self.plan.destinations(self.prefill_rank)

    @property
    def status_only(self) -> bool:
        return self.plan.status_only(self.prefill_rank)

    def slices(self, decode_rank: int) -> tuple[HeadSlice, ...]:
        return self.plan.between(self.prefill_rank, decode_rank)

    def whole_pages(self, decode_rank: int) -> bool:
        """What this rank writes into ``decode_rank`` is its whole pages (every head; its
        stage's layers)."""
        return self.plan.whole_pages(self.prefill_rank, decode_rank)


def sender_duty(prefill: RankPlace, decode: RankPlace) -> SenderDuty:
    """The duty of the prefill rank at ``prefill`` towards a decode server laid out as
    ``decode`` (only its TP size and head layout matter; raises :class:`LayoutError` when no
    plan serves the two)."""
    return SenderDuty(plan=plan_slices(prefill.tp_layout, decode.tp_layout),
                      prefill_rank=prefill.tp_rank, layers=prefill.layers)


def source_count(prefill: RankPlace, decode: RankPlace) -> int:
    """How many prefill ranks must report success before ``decode``'s room is complete: its
    sources in every pipeline stage of a server laid out as ``prefill`` (any of its ranks)."""
    _refuse(prefill.rank, decode, place_mismatches(prefill, decode))
    plan = _plan(prefill.rank, prefill, decode)
    return len(plan.sources(decode.tp_rank)) * prefill.pp_size
