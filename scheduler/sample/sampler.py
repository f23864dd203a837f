"""The sampler: one row of logits per request becomes its next token (and, when asked, its logprob).

Per row, in order:

1. **adjust** — the request's penalties over its output so far (:attr:`RowSpec.history`):
   ``frequency_penalty`` times each token's count and ``presence_penalty`` are subtracted, then
   ``repetition_penalty`` divides the positive logits of those tokens and multiplies the
   negative ones; ``logit_bias`` is added (a biased logit held within ``±BIASED_MAX``); the
   tokens ``min_new_tokens`` still excludes (:attr:`RowSpec.banned`) go to -inf;
2. **mask** — a constraint's allowed tokens (a mask that allows nothing is not applied: the
   constraint then rejects whatever comes, and the request fails naming its grammar). Where
   the exclusion would leave no token to draw (a grammar that allows only EOS and stop tokens
   here, such as a complete one), the row is adjusted again without it: the grammar wins, and
   the answer ends on the token drawn (docs/structured-output.md). A row that still has no
   finite logit (the model's logits are not finite) raises :class:`NoTokenToDraw` rather than
   reach the draw;
3. **greedy** (``SamplingParams.greedy``: a temperature below 1e-6, or a top-k of 1) — the
   lowest id of the maximum, the rule ``fixed_point.greedy_token_ids`` and ``torch.argmax``
   follow, so greedy over a runner's logits is its ``forward``;
4. otherwise **sample** — ``softmax(logits / temperature)`` in float64 on the CPU; tokens in
   the order (probability descending, id ascending); kept: the first ``top_k`` (0: all), the
   smallest prefix whose mass reaches ``top_p`` (at least one token), those with probability
   at least ``min_p`` times the largest. Each filter keeps a prefix of the order, so together
   they keep the shortest of the three. The token is the first kept one whose cumulative mass
   exceeds ``u * total`` (``total``: the kept mass, i.e. renormalised), ``u`` the draw of the
   row's output position in the request's seeded stream (:mod:`.stream`).

Logprobs are those of the adjusted row (at the request's temperature). Rows that are greedy
with nothing else asked take the argmax on the device and skip the rest.
:class:`RowSpec` is immutable (the mask is computed before the forward starts), so sampling can
run on the device thread as part of the forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import torch

from lifecycle import SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.sample.logprobs import asked_of, scaled, top_tokens
from scheduler.sample.stream import uniform


@attrs.frozen(eq=False)
class RowSpec:
    """How one row of logits becomes a token: the request's parameters, its stream's seed, the
    output position drawn, the tokens a constraint allows (None: any), the output tokens before
    this position (for the penalties) and the tokens ``min_new_tokens`` excludes here."""

    params: SamplingParams
    seed: int = 0
    position: int = 0
    mask: torch.Tensor | None = None
    history: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()

    @property
    def adjusted(self) -> bool:
        """Whether the row changes before the mask (:func:`adjust` does something)."""
        p = self.params
        return bool((p.penalized and self.history) or self.banned or p.logit_bias)

    @property
    def argmax_only(self) -> bool:
        return (self.params.greedy and not self.params.return_logprob and self.mask is None
                and not self.adjusted)


class NoTokenToDraw(RuntimeError):
    """A row has no token to draw: no logit is finite once adjusted and masked, so the model's
    are not (an internal error: the batch fails)."""


@attrs.frozen
class Sampled:
    """A row's token, and its logprob when the request asked (``return_logprob``)."""

    token: int
    logprob: TokenLogprob | None = None


def sample(logits: torch.Tensor, specs: Sequence[RowSpec]) -> list[Sampled]:
    """One token per row of ``logits`` (``[len(specs), vocab]``, any float dtype and device)."""
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(specs)} requests")
    out: list[Sampled | None] = [None] * len(specs)
    fast = [i for i, s in enumerate(specs) if s.argmax_only]
    if fast:
        picked = logits[fast].argmax(-1).tolist() if len(fast) < len(specs) else (
            logits.argmax(-1).tolist())
        for i, token in zip(fast, picked, strict=True):
            out[i] = Sampled(int(token))
    rest = [i for i, s in enumerate(specs) if not s.argmax_only]
    if rest:
        rows = logits[rest].to("cpu", torch.float64)
        for j, i in enumerate(rest):
            out[i] = _sample_row(rows[j], specs[i])
    return [s for s in out if s is not None]


#: The largest biased logit: divided by a temperature of at least
#: :data:`lifecycle.prefill.GREEDY_BELOW`, it and the logprobs it leads to stay finite in
#: float32 too (the metadata row carries the first token's).
BIASED_MAX = 1e30


def adjust(row: torch.Tensor, spec: RowSpec, *, ban: bool = True) -> torch.Tensor:
    """``row`` (one request's logits, 1-D) with its penalties, logit bias and (unless not
    ``ban``) ``min_new_tokens`` exclusion applied (a new tensor when anything applies)."""
    if not spec.adjusted:
        return row
    params = spec.params
    row = row.clone()
    if params.penalized and spec.history:
        occurred = Counter(spec.history)
        ids = list(occurred)
        counts = torch.tensor(list(occurred.values()), dtype=row.dtype, device=row.device)
        values = row[ids] - params.frequency_penalty * counts - params.presence_penalty
        penalty = params.repetition_penalty
        if penalty != 1.0:
            values = torch.where(values < 0, values * penalty, values / penalty)
        row[ids] = values
    if params.logit_bias:
        biased = [token for token, _ in params.logit_bias]
        values = row[biased] + torch.tensor([b for _, b in params.logit_bias],
                                            dtype=row.dtype, device=row.device)
        row[biased] = values.clamp(-BIASED_MAX, BIASED_MAX)
    if ban and spec.banned:  # after the bias: no bias brings a banned token back
        row[[t for t in spec.banned if t < row.numel()]] = -float("inf")
    return row


def _sample_row(logits: torch.Tensor, spec: RowSpec) -> Sampled:
    params = spec.params
    mask = spec.mask
    if mask is not None and not bool(mask.any()):
        mask = None
    row = _masked(adjust(logits, spec), mask)
    if spec.banned and not _drawable(row):
        # min_new_tokens holds back EOS and stop tokens while something else may come; here
        # the grammar allows nothing else, and the grammar wins.
        row = _masked(adjust(logits, spec, ban=False), mask)
    if not _drawable(row):
        raise NoTokenToDraw(f"no logit of the row is finite after the request's adjustments "
                            f"and mask (output position {spec.position}): the model's logits "
                            "are not finite")
    if params.greedy:
        token = int(row.argmax())
    else:
        token = _draw(row, params, uniform(spec.seed, spec.position))
    if not params.return_logprob:
        return Sampled(token)
    logprobs = torch.log_softmax(scaled(row, params), -1)
    top = top_tokens(logprobs[None], params.top_logprobs_num)[0]
    asked = asked_of(logprobs[None], params.token_ids_logprob)[0]
    return Sampled(token, TokenLogprob(token, float(logprobs[token]), top, asked))


def _masked(row: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return row
    return row.masked_fill(~mask.to(row.device), -float("inf"))


def _drawable(row: torch.Tensor) -> bool:
    """Whether some token of ``row`` has a finite logit (argmax and the draw need one)."""
    return bool(torch.isfinite(row).any())


def _draw(row: torch.Tensor, params: SamplingParams, u: float) -> int:
    probs = torch.softmax(row / params.temperature, -1)
    # Stable on equal probabilities: the lower id first.
    ordered, ids = probs.sort(descending=True, stable=True)
    mass = ordered.cumsum(0)
    keep = int((mass - ordered < params.top_p).sum())
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.min_p > 0.0:
        keep = min(keep, int((ordered >= params.min_p * ordered[0]).sum()))
    keep = max(keep, 1)
    kept = mass[:keep]
    index = int(torch.searchsorted(kept, u * float(kept[-1]), right=True))
    return int(ids[min(index, keep - 1)])


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The greedy token of each row (the lowest id of the maximum)."""
    ids: list[int] = logits.argmax(-1).tolist()
    return ids
