"""One side's reference model over its pools: the full-attention pool, and what a hybrid model
or a draft model keeps beside it.

A prefill scheduler and a decode peer of a hybrid reference model
(:class:`~scheduler.model.reference_config.LayerKind`) each hold, beside the full pool their
runner writes, an SWA pool for the sliding-window layers, recurrent-state slots for the
recurrent layers and, for speculative decoding, a draft model's pool at the full pool's page
indices. :func:`build_side` builds them from one :class:`HybridConfig`, which both sides of a
pair share (the transfer's handshake refuses pools that differ), and returns the runner with
the :class:`~kv.state_pools.StatePools` the scheduler, the peer and the local backend are
given.
"""

from __future__ import annotations

import attrs

from kv.metadata import SPEC_TOP_K
from kv.pool import KVPool
from kv.state_pools import RecurrentPool, StatePools, SWAPool
from lifecycle.validators import typed_fields
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner


def _non_negative(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"HybridConfig.{attribute.name} must be an integer >= 0, got {value!r}")


#: Proposals per round of speculative decoding unless ``HybridConfig.speculative_k`` says.
DEFAULT_SPECULATIVE_K = 3


def _proposals(_instance: object, attribute: attrs.Attribute[int | None],
               value: int | None) -> None:
    # The prefill side hands the draft's proposals over in one metadata row of SPEC_TOP_K.
    if value is not None and not 1 <= value <= SPEC_TOP_K:
        raise ValueError(f"HybridConfig.{attribute.name} must be in 1..{SPEC_TOP_K} (proposals "
                         f"per round, at most the {SPEC_TOP_K} a hand-off carries) or None "
                         f"({DEFAULT_SPECULATIVE_K} with a draft), got {value!r}")


@attrs.frozen(field_transformer=typed_fields)
class HybridConfig:
    """What each side holds beside its full pool (for a model whose config has sliding-window
    or recurrent layers, or with a draft).

    ``swa_pages``: pages of the SWA pool (0: as many as the full pool); ``state_slots``:
    recurrent-state slots, so requests that hold pages at once; ``draft_layers``: the draft
    model's layers, the target's first (0: no draft, no speculative decoding);
    ``speculative_k``: proposals per round (and top-k proposals in the hand-off), 1 ..
    :data:`~kv.metadata.SPEC_TOP_K`; None: :data:`DEFAULT_SPECULATIVE_K` with a draft (given
    without one, it is refused)."""

    swa_pages: int = attrs.field(default=0, validator=_non_negative)
    state_slots: int = attrs.field(default=64, validator=_non_negative)
    draft_layers: int = attrs.field(default=0, validator=_non_negative)
    speculative_k: int | None = attrs.field(default=None, validator=_proposals)

    @property
    def proposals(self) -> int:
        """Proposals per round: ``speculative_k``, or :data:`DEFAULT_SPECULATIVE_K`."""
        return DEFAULT_SPECULATIVE_K if self.speculative_k is None else self.speculative_k


def _unused(config: ModelConfig, hybrid: HybridConfig) -> str:
    """What of ``hybrid`` would change nothing on a model of ``config`` ("" when all is used: a
    setting taken without effect reads as one that works). One config may serve models of
    different kinds: an SWA pool's size is not refused for a model without sliding-window
    layers, but a config that builds nothing at all is."""
    if hybrid.speculative_k is not None and not hybrid.draft_layers:
        return f"speculative_k={hybrid.speculative_k} without a draft (draft_layers=0)"
    if not (config.hybrid or hybrid.draft_layers):
        return ("the model has no sliding-window or recurrent layers and there is no draft "
                "(draft_layers=0): it would change nothing; leave it None, or set draft_layers "
                "for speculative decoding")
    return ""


@attrs.frozen
class SideModel:
    """A side's target runner, its state pools (None when it keeps nothing beside the full
    pool) and its draft runner (None without a draft)."""

    runner: PagedModelRunner
    states: StatePools | None
    draft: PagedModelRunner | None


def build_side(model: LlamaModel, pool: KVPool, hybrid: HybridConfig) -> SideModel:
    """The pools ``model`` needs beside ``pool`` (in its layout and page size), and the
    runners over them. ValueError for a draft with hybrid layers (not built), pools that
    cannot be sized, and a ``hybrid`` that would change nothing."""
    c, ps = model.config, pool.page_size
    unused = _unused(c, hybrid)
    if unused:
        raise ValueError(f"HybridConfig: {unused}")
    swa = None
    if c.swa_layers:
        swa_pool = model.make_swa_pool(
            num_pages=hybrid.swa_pages or pool.num_pages, page_size=ps, layout=pool.layout
        )
        swa = SWAPool(window=c.sliding_window, pool=swa_pool, full_pages=pool.num_pages)
    recurrent = None
    if c.recurrent_layers:
        if hybrid.state_slots < 1:
            raise ValueError(
                "HybridConfig.state_slots must be >= 1 for a model with recurrent layers"
            )
        recurrent = RecurrentPool(model.make_states(hybrid.state_slots))
    draft = None
    if hybrid.draft_layers > c.layers:
        raise ValueError(f"HybridConfig.draft_layers must be in 0..{c.layers} (0: no draft; the "
                         f"draft is the target's first layers, of {c.layers}), got "
                         f"{hybrid.draft_layers}")
    if hybrid.draft_layers:
        in_draft = sorted(i for i in (*c.swa_layers, *c.recurrent_layers)
                          if i < hybrid.draft_layers)
        if in_draft:
            raise ValueError(
                f"a draft of {hybrid.draft_layers} layers (the target's first) has "
                f"sliding-window or recurrent layers {in_draft}; a hybrid draft is not built: "
                "give HybridConfig.draft_layers the full-attention layers before the first "
                "hybrid one"
            )
        draft_model = model.draft(hybrid.draft_layers)
        draft = PagedModelRunner(
            draft_model,
            draft_model.make_pool(num_pages=pool.num_pages, page_size=ps, layout=pool.layout),
        )
    runner = PagedModelRunner(
        model,
        pool,
        swa_pool=None if swa is None else swa.pool,
        states=None if recurrent is None else recurrent.buffer,
    )
    if swa is None and recurrent is None and draft is None:
        return SideModel(runner, None, None)
    states = StatePools(
        pool, swa=swa, recurrent=recurrent, draft=None if draft is None else draft.pool
    )
    return SideModel(runner, states, draft)


def check_runner_states(runner: object, states: StatePools | None) -> None:
    """ValueError unless the SWA pool and recurrent states a hybrid runner computes in (its
    ``swa_pool`` and ``states``, for a runner that has them) are those of ``states``: a side's
    transfer sends from, or lands in, the state pools, so other pools would hold what no forward
    wrote, or feed the runner what no transfer landed."""
    for attr, name, theirs in (
        ("swa_pool", "SWA pool", None if states is None or states.swa is None
         else states.swa.pool),
        ("states", "recurrent state", None if states is None or states.recurrent is None
         else states.recurrent.buffer),
    ):
        if getattr(runner, attr, theirs) is theirs:
            continue
        if states is None:
            raise ValueError(f"states: the runner {type(runner).__name__} has its {name} "
                             f"({attr}), but no state pools were given: pass states= built "
                             "with the runner (build_side(...).states)")
        raise ValueError(f"states: the state pools' {name} is not the runner's {attr}: the "
                         "runner would compute in one and the transfer use the other (build "
                         "the runner and states= with one build_side)")
