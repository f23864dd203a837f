"""Logprobs: the top alternatives of a row, and the prompt's input logprobs across chunks.

A reported logprob is ``log_softmax(logits)`` for a greedy request and
``log_softmax(logits / temperature)`` otherwise (SGLang's default), for input and output tokens
alike. The top alternatives of a position are the ``top_logprobs_num`` most likely tokens, most
likely first, ties to the lower id; only tokens with a finite logprob are listed (a grammar's
mask gives the tokens it forbids ``-inf``).

Input logprobs score prompt token ``i`` by the logits of position ``i - 1`` (token 0 has none:
nothing predicts it), for ``i`` from ``logprob_start_len`` on. A chunk's all-position logits
score the tokens after its positions, so the last position of a non-last chunk scores the next
chunk's first token, which the prompt tells. The scored positions must be computed, not taken
from the prefix cache: :func:`first_scored_position` bounds a cache match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lifecycle import SamplingParams
from scheduler.messages import TokenLogprob

Top = tuple[tuple[int, float], ...]


def scaled(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits a reported logprob is the log-softmax of (divided by the temperature unless
    greedy)."""
    return logits if params.greedy else logits / params.temperature


def top_tokens(logprobs: torch.Tensor, k: int) -> list[Top]:
    """Per row of ``logprobs`` (``[rows, vocab]``), its ``k`` largest entries as ``(token,
    value)`` pairs, largest first, ties to the lower id, finite values only."""
    rows, vocab = logprobs.shape
    k = min(k, vocab)
    if k <= 0 or rows == 0:
        return [() for _ in range(rows)]
    values, ids = logprobs.topk(k, dim=-1)
    threshold = values[:, -1:]
    if bool(((logprobs >= threshold).sum(-1) > k).any()):
        # Ties at the cut: take every entry above it and the lowest ids of those on it.
        above = logprobs > threshold
        on = logprobs == threshold
        room = k - above.sum(-1, keepdim=True)
        chosen = above | (on & (on.cumsum(-1) <= room))
        ids = chosen.nonzero()[:, 1].view(rows, k)  # row-major: ids ascending in each row
    else:
        ids = ids.sort(-1).values
    values = logprobs.gather(1, ids)
    # A stable sort of ascending ids by value, descending: equal values keep the lower id first.
    order = values.sort(dim=-1, descending=True, stable=True).indices
    id_rows: list[list[int]] = ids.gather(1, order).tolist()
    value_rows: list[list[float]] = values.gather(1, order).tolist()
    return [tuple((t, v) for t, v in zip(row_ids, row_values, strict=True) if v > -math.inf)
            for row_ids, row_values in zip(id_rows, value_rows, strict=True)]


def asked_of(logprobs: torch.Tensor, ids: Sequence[int]) -> list[Top]:
    """Per row of ``logprobs`` (``[rows, vocab]``), the values at ``ids`` as ``(token, value)``
    pairs in the order of ``ids`` (a request's ``token_ids_logprob``; -inf stays)."""
    if not ids:
        return [() for _ in range(logprobs.shape[0])]
    rows: list[list[float]] = logprobs[:, list(ids)].tolist()
    return [tuple(zip(ids, row, strict=True)) for row in rows]


def wants_input_logprobs(params: SamplingParams, prompt_len: int) -> bool:
    """Whether the request returns logprobs of its prompt tokens."""
    return params.return_logprob and 0 <= params.logprob_start_len < prompt_len


def first_scored_position(params: SamplingParams) -> int:
    """The first position whose logits score a prompt token the request asked about (a prefix
    cache match must end at or before it)."""
    return max(params.logprob_start_len, 1) - 1


def needs_all_logits(params: SamplingParams, prompt_len: int, start: int, end: int) -> bool:
    """Whether the chunk of positions ``start .. end-1`` holds positions that score prompt
    tokens the request asked about (positions up to ``prompt_len - 2``)."""
    return (wants_input_logprobs(params, prompt_len)
            and start <= prompt_len - 2 and end - 1 >= first_scored_position(params))


def first_entries(params: SamplingParams, prompt: Sequence[int]) -> list[TokenLogprob]:
    """The input logprobs known before any forward: token 0's (None) when it was asked for."""
    if wants_input_logprobs(params, len(prompt)) and params.logprob_start_len == 0:
        return [TokenLogprob(prompt[0], None)]
    return []


#: Prompt positions whose input logprobs are taken at once (:func:`chunk_input_logprobs`).
_SCORED_ROWS_AT_ONCE = 256


def chunk_input_logprobs(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], start: int,
) -> list[TokenLogprob]:
    """The input logprobs the all-position ``logits`` of a chunk starting at ``start`` give:
    prompt token ``p + 1`` for each of its positions ``p`` that scores an asked-for token."""
    lo = max(start, first_scored_position(params))
    hi = min(start + logits.shape[0], len(prompt) - 1)  # position len-1 scores the output
    if lo >= hi:
        return []
    k, ids = params.top_logprobs_num, params.token_ids_logprob
    out: list[TokenLogprob] = []
    # A block of rows at a time: the log-softmax's temporaries are each as large as the logits
    # they are taken of, so they stay a block's size (a chunk's would be 196 KB a position on
    # SmolLM2's vocabulary, several of them at once).
    for at in range(lo, hi, _SCORED_ROWS_AT_ONCE):
        end = min(at + _SCORED_ROWS_AT_ONCE, hi)
        rows = scaled(logits[at - start : end - start].float(), params)
        targets = torch.tensor(prompt[at + 1 : end + 1], dtype=torch.int64, device=rows.device)
        norm = torch.logsumexp(rows, -1, keepdim=True)
        chosen = (rows.gather(1, targets[:, None]) - norm)[:, 0].tolist()
        logprobs = rows - norm if k or ids else rows
        tops = top_tokens(logprobs, k) if k else [() for _ in chosen]
        asked = asked_of(logprobs, ids)
        out += [TokenLogprob(int(t), lp, top, ask) for t, lp, top, ask in zip(
            prompt[at + 1 : end + 1], chosen, tops, asked, strict=True)]
    return out
