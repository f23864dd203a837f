"""The prefill ranks a bootstrap endpoint knows: each rank's place in its server's mesh, what
part of the model's KV its pool holds, and the checks a new registration must pass.

Theory of operation
-------------------
A prefill server runs ``dp_size`` data-parallel replicas, each a mesh of ``pp_size`` pipeline
stages of ``tp_size`` tensor-parallel ranks. Every rank registers a :class:`RankInfo`: where it
takes control messages, its pool settings (page size, KV dtype, pool layout, head dim, model)
and its :class:`RankPlace` (TP, PP and DP coordinates, the model's KV head count and whether it
is an MLA latent, the model's layer count and the contiguous layers this rank's stage holds).
A rank's number is its place in the server, stage-major within a DP replica:
``rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank`` (the TP rank ``t`` of stage ``s``
is ``s * tp_size + t``, as :func:`scheduler.model.sharded.build_mesh` orders a mesh).

A registration is refused (:func:`registration_conflict`) when its rank number is not its place,
when it names a mesh of another size than the endpoint expects, or when it disagrees with a rank
already registered on anything every rank must share (the pool settings, the model's layer and
head counts, MLA, the mesh sizes), or on its stage's layers (the same stage holds the same
layers on every rank; stages hold consecutive layers in stage order, from layer 0 to the last).
Every message names both ranks and both values. A registration read from JSON (``PUT /route``
at the endpoint, ``GET /route`` at a decode peer) must name its control endpoint as
``tcp://HOST:PORT`` that ZeroMQ can connect to (:meth:`RankInfo.from_json`): one it cannot parse
would fail the decode peer only once it had opened its engine and sockets.

The decode side reads the table and computes whom to contact (:mod:`kv.routes`). This module is
arithmetic and records only: no torch, no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from kv.layouts import LayoutError, TPLayout
from kv.model_id import MAX_MODEL_NAME, describe_model
from kv.pool_layout import KV_LAYOUTS, KVLayout
from kv.wire import KV_DTYPES
from lifecycle.validators import one_of

#: The largest TP, PP or DP size a registration may name.
MAX_RANKS = 1 << 12

#: A host name: labels of letters, digits, ``-`` and ``_``, joined by dots.
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                        r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


def _endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not ``tcp://HOST:PORT`` (HOST a host name, an IPv4 address or an IPv6
    address, bracketed or not; PORT in 1..65535), or None."""
    want = "must be 'tcp://HOST:PORT' (a host name or IP address, a port in 1..65535)"
    host, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://"):
        return f"{want}, got {endpoint!r}"
    if not colon:
        return f"{want}, got {endpoint!r}: no port"
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return f"{want}, got {endpoint!r}: port {port!r}"
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ipaddress.ip_address(host[1:-1] if bracketed else host)
        return None
    except ValueError:
        pass
    if bracketed or len(host) > 253 or not _HOST_NAME.fullmatch(host):
        return f"{want}, got {endpoint!r}: host {host!r}"
    return None


def _count(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """An int that is not a bool (JSON's ``true`` must not pass for ``1``), at least 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class RankPlace:
    """Where one rank sits in its server's mesh, and which part of the model's KV it holds."""

    tp_rank: int = attrs.field(default=0, validator=_count)
    tp_size: int = attrs.field(default=1, validator=_count)
    pp_rank: int = attrs.field(default=0, validator=_count)
    pp_size: int = attrs.field(default=1, validator=_count)
    dp_rank: int = attrs.field(default=0, validator=_count)
    dp_size: int = attrs.field(default=1, validator=_count)
    #: The model's KV heads (all ranks together; the latent's heads with MLA).
    kv_heads: int = attrs.field(validator=_count)
    #: The KV is a latent every TP rank holds whole (DeepSeek-style MLA).
    mla: bool = attrs.field(default=False, validator=_flag)
    #: The model's layer count, and the model layers this rank's stage holds (its pool's layer
    #: ``i`` is model layer ``layer_start + i``).
    num_layers: int = attrs.field(validator=_count)
    layer_start: int = attrs.field(validator=_count)
    layer_stop: int = attrs.field(validator=_count)

    def __attrs_post_init__(self) -> None:
        for name, rank, size in (("tp", self.tp_rank, self.tp_size),
                                 ("pp", self.pp_rank, self.pp_size),
                                 ("dp", self.dp_rank, self.dp_size)):
            if not 1 <= size <= MAX_RANKS:
                raise ValueError(f"{name}_size must be in 1..{MAX_RANKS}, got {size}")
            if rank >= size:
                raise ValueError(f"{name}_rank {rank} is not in {name}_size {size}")
        if not 0 <= self.layer_start < self.layer_stop <= self.num_layers:
            raise ValueError(
                f"layers {self.layer_start}..{self.layer_stop} are not a non-empty part of the "
                f"model's {self.num_layers}")
        if self.pp_size > self.num_layers:
            raise ValueError(f"pp_size {self.pp_size} exceeds the {self.num_layers} layers")
        try:
            self.tp_layout  # noqa: B018 (validates heads against the TP size)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def single(cls, *, num_layers: int, kv_heads: int, mla: bool = False) -> RankPlace:
        """The one rank of a server without parallelism: every head of every layer."""
        return cls(kv_heads=kv_heads, mla=mla, num_layers=num_layers, layer_start=0,
                   layer_stop=num_layers)

    @property
    def rank(self) -> int:
        """This rank's number in its server (stage-major within a DP replica)."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def layers(self) -> range:
        """The model layers this rank's stage holds."""
        return range(self.layer_start, self.layer_stop)

    @property
    def tp_layout(self) -> TPLayout:
        """How this rank's TP group splits the model's KV heads."""
        return TPLayout(self.tp_size, self.kv_heads, self.mla)

    @property
    def heads_per_rank(self) -> int:
        """The KV heads in this rank's page (its pool's ``kv_heads``)."""
        return self.tp_layout.heads_per_rank


@attrs.frozen
class RankInfo:
    """One prefill rank, as registered at the bootstrap endpoint."""

    rank: int = attrs.field(validator=_count)
    endpoint: str = attrs.field(validator=attrs.validators.instance_of(str))
    session: str = attrs.field(validator=attrs.validators.instance_of(str))
    page_size: int = attrs.field(validator=[_count, attrs.validators.ge(1)])
    kv_dtype: str = attrs.field(validator=one_of(KV_DTYPES))
    #: The model whose KV the rank's pool holds: its fingerprint (compared) and its name.
    model: str = attrs.field(default="", validator=[
        attrs.validators.instance_of(str), attrs.validators.max_len(MAX_MODEL_NAME)])
    model_name: str = attrs.field(default="", validator=[
        attrs.validators.instance_of(str), attrs.validators.max_len(MAX_MODEL_NAME)])
    #: The order of the rank's pool tensor (:mod:`kv.pool_layout`).
    kv_layout: str = attrs.field(default=KVLayout.LAYER_MAJOR.value,
                                 validator=one_of(KV_LAYOUTS))
    head_dim: int = attrs.field(kw_only=True, validator=[_count, attrs.validators.ge(1)])
    place: RankPlace = attrs.field(kw_only=True,
                                   validator=attrs.validators.instance_of(RankPlace))

    @property
    def model_label(self) -> str:
        return describe_model(self.model_name, self.model)

    @endpoint.validator
    def _check_endpoint(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not value.startswith("tcp://"):
            raise ValueError(f"endpoint must be 'tcp://host:port', got {value!r}")

    @classmethod
    def from_json(cls, body: Any) -> RankInfo:
        """Raises ValueError/TypeError naming the field when ``body`` is not a valid rank (an
        endpoint ZeroMQ cannot connect to included)."""
        fields = _exact_fields(cls, body)
        info = cls(**{**fields, "place": RankPlace(**_exact_fields(RankPlace, body["place"]))})
        problem = _endpoint_problem(info.endpoint)
        if problem:
            raise ValueError(f"endpoint {problem}")
        return info


_T = TypeVar("_T")


def _exact_fields(cls: type[_T], body: Any) -> dict[str, Any]:
    """``body`` as keyword arguments of ``cls``; every field present, no other."""
    if not isinstance(body, dict):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    names = {f.name for f in attrs.fields(cls)}  # type: ignore[arg-type]
    missing, extra = names - set(body), set(body) - names
    if missing or extra:
        raise ValueError(f"missing fields {sorted(missing)}, unexpected {sorted(extra)}")
    return dict(body)


@attrs.frozen
class PrefillInfo:
    """What ``GET /route`` tells a decode peer: every rank, the shared geometry and model, and
    whether the endpoint requires a peer token."""

    page_size: int
    kv_dtype: str
    ranks: tuple[RankInfo, ...]
    token_required: bool = False
    model: str = ""
    model_name: str = ""
    kv_layout: str = KVLayout.LAYER_MAJOR.value
    #: The prefill ranks take a decode rank's ``Register`` again as its keepalive and forget a
    #: silent one (a server that does not say so predates keepalives: it is sent neither).
    keepalive: bool = False
    #: The prefill ranks take a decode rank's ``Watch`` (:class:`kv.wire.Watch`); a server that
    #: does not say so predates it and is sent none.
    watch: bool = False
    #: The bootstrap server's instance (:attr:`kv.bootstrap.BootstrapServer.instance`; "" from
    #: one that names none).
    instance: str = ""

    @property
    def model_label(self) -> str:
        return describe_model(self.model_name, self.model)

    def replica(self, dp_rank: int) -> tuple[RankInfo, ...]:
        """The ranks of DP replica ``dp_rank``, by rank."""
        return tuple(r for r in self.ranks if r.place.dp_rank == dp_rank)


#: What every rank of a prefill server shares, and what a decode pool must share with it: the
#: pool settings (:data:`POOL_FIELDS`) and the model's KV shape (:data:`MODEL_FIELDS`).
POOL_FIELDS = ("page_size", "kv_dtype", "kv_layout", "head_dim")
MODEL_FIELDS = ("num_layers", "kv_heads", "mla")
_MESH_FIELDS = ("tp_size", "pp_size", "dp_size")


def shared_values(info: RankInfo) -> dict[str, object]:
    """The values every rank of one server must agree on, by name."""
    values: dict[str, object] = {name: getattr(info, name) for name in POOL_FIELDS}
    for name in MODEL_FIELDS + _MESH_FIELDS:
        values[name] = getattr(info.place, name)
    return values


def differences(mine: Mapping[str, object], theirs: Mapping[str, object]) -> str:
    """``a=1 b=2`` for the names whose values differ, in ``mine``'s order (for messages)."""
    return " ".join(f"{k}={mine[k]}" for k in mine if mine[k] != theirs.get(k))


def registration_conflict(info: RankInfo, registered: Mapping[int, RankInfo],
                          expected_ranks: int) -> str | None:
    """Why ``info`` may not join the ranks already ``registered`` at an endpoint that expects
    ``expected_ranks``, or None. A rank may register again (a restart) if it still agrees."""
    place = info.place
    if info.rank >= expected_ranks:
        return f"rank {info.rank} not in 0..{expected_ranks - 1}"
    if place.world_size != expected_ranks:
        return (f"rank {info.rank} names a mesh of tp_size={place.tp_size} pp_size="
                f"{place.pp_size} dp_size={place.dp_size} ({place.world_size} ranks), the "
                f"endpoint expects {expected_ranks} ranks")
    if place.rank != info.rank:
        return (f"rank {info.rank} is at tp_rank={place.tp_rank} pp_rank={place.pp_rank} "
                f"dp_rank={place.dp_rank}, which is rank {place.rank}")
    last = place.pp_rank == place.pp_size - 1
    if (place.pp_rank == 0 and place.layer_start != 0) or (
            last and place.layer_stop != place.num_layers):
        return (f"rank {info.rank} is stage {place.pp_rank} of {place.pp_size} but holds "
                f"layers {place.layer_start}..{place.layer_stop} of {place.num_layers}: the "
                "stages must hold the layers from 0 to the last, in order")
    mine = shared_values(info)
    for other in registered.values():
        if other.rank == info.rank:
            continue
        theirs = shared_values(other)
        if mine != theirs:
            return (f"rank {info.rank} has {differences(mine, theirs)} but rank {other.rank} "
                    f"has {differences(theirs, mine)}")
        if other.model != info.model:
            return (f"rank {info.rank} serves model {info.model_label} but rank "
                    f"{other.rank} serves {other.model_label}")
        problem = _stage_conflict(info, other)
        if problem:
            return problem
    return None


def _stage_conflict(info: RankInfo, other: RankInfo) -> str | None:
    """Two ranks' layers must be those of their stages: equal in one stage, consecutive from
    one stage to the next, apart otherwise."""
    a, b = info.place, other.place
    if a.pp_rank == b.pp_rank:
        ok = a.layers == b.layers
    elif abs(a.pp_rank - b.pp_rank) == 1:
        first, second = (a, b) if a.pp_rank < b.pp_rank else (b, a)
        ok = first.layer_stop == second.layer_start
    else:
        first, second = (a, b) if a.pp_rank < b.pp_rank else (b, a)
        ok = first.layer_stop < second.layer_start
    if ok:
        return None
    return (f"rank {info.rank} (stage {a.pp_rank}) holds layers {a.layer_start}..{a.layer_stop} "
            f"but rank {other.rank} (stage {b.pp_rank}) holds {b.layer_start}..{b.layer_stop}: "
            "a stage's ranks hold the same layers, and the stages consecutive ones in order")
