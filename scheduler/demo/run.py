"""The run behind ``pdlife demo``: workload, the in-process pair, the driving loop, the check.

Theory of operation
-------------------
One process holds a prefill scheduler and its decode peer
(:class:`~scheduler.embedded.EmbeddedPair`): over the local backend, or over Mooncake on loopback
TCP with a bootstrap endpoint. The calling thread drives both loops pass by pass.

The workload (:func:`make_workload`) is seeded: prompts of generated text, 16 to ``max_prompt``
(default 2048) byte tokens, with mixed ``max_new_tokens`` and stop tokens. Most requests go the
disaggregated way. A few are sent to the fake backend (bootstrap host ``2.2.2.2``) in rooms whose
:class:`~kv.fake.FaultPlan` decision fails the bootstrap or the transfer. A few are aborted
mid-flight: each abort is issued between passes, as soon as the request's prefill record is seen
in (or past) its target state (WAITING, FORWARD between chunks, TRANSFERRING), so it always
reaches a live request; the state it really landed in is read back from the timeline.

Every answer (prefill's :class:`~scheduler.messages.Response`, decode's
:class:`~scheduler.decode.DecodeResponse`) carries its request's whole lifecycle timeline, so the
report (final states, where each abort landed, TTFT phases, the trace) is built from the answers
alone, once the run is over; nothing is read from the schedulers' records for it.

The run passes when every request ended as planned (served, failed by its injected fault, or
aborted), the resource invariants hold at the end, and every served output equals the colocated
reference model's token for token (:func:`colocated_reference`, replaceable to test the check).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from kv.fake import FaultPlan
from kv.local import LocalKVManager
from lifecycle import PrefillState, SamplingParams
from scheduler.demo.options import DemoOptions
from scheduler.demo.records import DemoRequest, Mismatch, RunData
from scheduler.demo.report import Progress, finish_report, planned_line
from scheduler.dist.gather import StaticGather
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.messages import FAKE_BOOTSTRAP_HOST, NewRequest
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import LlamaModel, ReferenceModel
from scheduler.model.select import REFERENCE, ServedModel, load_model
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerConfig, PrefillDelayer
from scheduler.stepping import step_or_rest

logger = logging.getLogger(__name__)

MIN_PROMPT_TOKENS = 16
PAGE_SIZE = 16
# Fake-backend rooms are numbered apart from the disaggregated ones, for readable traces.
FAKE_ROOM_BASE = 1_000_000
ABORT_TARGETS = (PrefillState.FORWARD, PrefillState.TRANSFERRING, PrefillState.WAITING)
FAULTS = ("bootstrap_failed", "transfer_failed")
_WORDS = (
    "prefill", "decode", "page", "chunk", "batch", "token", "cache", "room", "slot", "peer",
    "bootstrap", "transfer", "engine", "scheduler", "lifecycle", "state", "event", "forward",
    "queue", "budget", "delay", "rank", "gather", "poll", "abort", "the", "a", "of", "and",
    "to", "in", "is", "for", "with", "on", "while", "when", "each", "every", "request",
    "server", "model",
)


#: The questions a real model's workload asks (through its chat template).
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
    "List three colours of the rainbow.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water at sea level?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a friendly robot.",
    "What does a bee make?",
)
#: A long question: its prompt takes several chunks (an abort can land between them).
LONG_QUESTION = (
    "Summarise in one sentence: The history of astronomy is a long story of patient "
    "observation. Ancient farmers watched the rising of bright stars to know when to plant; "
    "sailors steered by the pole star; priests kept calendars of eclipses. With the telescope "
    "came moons around Jupiter, phases of Venus and the slow realisation that the Earth is one "
    "planet among many."
)
#: ``--max-prompt`` for a real model's workload (its chunk size follows from it).
REAL_MAX_PROMPT = 128


def fault_plan(seed: int) -> FaultPlan:
    """The fake backend's faults: half the rooms fail the bootstrap, half the transfer."""
    return FaultPlan(seed=seed, bootstrap_failure=0.5, transfer_failure=0.5)


def _fault_of(plan: FaultPlan, room: int) -> str:
    f = plan.decide(room)
    if f.bootstrap_failure:
        return "bootstrap_failed"
    if f.transfer_failure and not f.bootstrap_timeout:
        return "transfer_failed"
    return ""


def _text(rng: random.Random, length: int) -> tuple[int, ...]:
    words: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    text = " ".join(words).capitalize() + "."
    return tuple(ByteTokenizer().encode(text)[:length])


def scheduler_config(max_prompt: int) -> SchedulerConfig:
    """Chunked prefill cut so that the longest prompts take four chunks or more (several
    passes in FORWARD, with ``chunk_done`` events), and a batch budget of four chunks."""
    chunk = max(PAGE_SIZE, max_prompt // 4 // PAGE_SIZE * PAGE_SIZE)
    return SchedulerConfig(
        page_size=PAGE_SIZE, chunked_prefill_size=chunk, max_prefill_tokens=4 * chunk
    )


def make_workload(
    requests: int, seed: int, plan: FaultPlan, max_prompt: int = 2048,
    served: ServedModel | None = None,
) -> list[DemoRequest]:
    """``requests`` seeded requests with prompts of 16 to ``max_prompt`` tokens (with a real
    ``served`` model: chat questions, answered until EOS or up to 48 tokens):
    ``requests // 12`` (at least 2) with injected faults, ``requests // 16`` (at least 3)
    aborted, spread through the submission order."""
    rng = random.Random(seed)
    lo, hi = MIN_PROMPT_TOKENS, max_prompt
    chunk = scheduler_config(max_prompt).chunked_prefill_size
    assert chunk is not None
    num_faults = max(2, requests // 12)
    num_aborts = max(3, requests // 16)
    specials: list[tuple[str, PrefillState | None]] = [
        (FAULTS[i % len(FAULTS)], None) for i in range(num_faults)
    ]
    # Aborts in WAITING come last: by then the queue ahead of them is long.
    targets = sorted((ABORT_TARGETS[i % 3] for i in range(num_aborts)), reverse=True)
    specials += [("", t) for t in targets]
    positions = {(k + 1) * requests // (len(specials) + 1): s for k, s in enumerate(specials)}
    room = FAKE_ROOM_BASE
    out = []
    for i in range(requests):
        fault, abort_in = positions.get(i, ("", None))
        if abort_in is PrefillState.FORWARD:
            # Long enough to be chunked, so the abort lands between chunks.
            length = rng.randint(3 * chunk + 1, hi)
        else:
            length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        stops = (ord("."),) if rng.random() < 0.25 else ()
        sampling = SamplingParams(max_new_tokens=rng.randint(1, 32), stop_token_ids=stops)
        text, prompt = "", None
        if served is not None:
            long = abort_in is PrefillState.FORWARD
            text = LONG_QUESTION if long else QUESTIONS[i % len(QUESTIONS)]
            prompt = tuple(served.encode(text, chat=True))
            sampling = SamplingParams(max_new_tokens=rng.randint(16, 48))
        fake_room = 0
        if fault:
            room += 1
            while _fault_of(plan, room) != fault:
                room += 1
            fake_room = room
        out.append(DemoRequest(f"r{i:03d}", prompt or _text(rng, length), sampling, fault,
                               fake_room, abort_in, text))
    return out


# -- the run --------------------------------------------------------------------------------

#: The colocated output a served request must match: ``(model, request) -> output ids``.
Reference = Callable[[Any, DemoRequest], Sequence[int]]


def colocated_reference(model: Any, req: DemoRequest) -> list[int]:
    """``req``'s output from the colocated run (no chunks, no transfer, alone) of the
    reference model or a real one."""
    s = req.sampling
    if isinstance(model, LlamaModel):
        return ReferenceModel(model).generate(
            req.prompt, s.max_new_tokens, s.stop_token_ids, s.ignore_eos, rid=req.rid
        )
    from scheduler.model.llama import generate

    return generate(model, req.prompt, s.max_new_tokens, stop_token_ids=s.stop_token_ids,
                    ignore_eos=s.ignore_eos)


class DemoTimeout(RuntimeError):
    """The workload was not served within ``DemoOptions.timeout_s``; the message says how far
    it got. Raise the timeout for a larger workload, or look for a stuck request in the trace."""


@attrs.frozen
class DemoResult:
    """Exit status (0: every request ended as planned and every output matched), the summary
    written to ``out/summary.json``, and the output folder."""

    status: int
    summary: dict[str, Any]
    out: Path


def _make_pair(options: DemoOptions, plan: FaultPlan, delayer: PrefillDelayer,
               served: ServedModel | None) -> EmbeddedPair:
    config = PairConfig(
        scheduler=scheduler_config(_max_prompt(options, served)),
        overlap=options.loop == "overlap", backend=options.backend,
    )
    return EmbeddedPair(config, faults=plan, delayer=delayer, served=served)


def _max_prompt(options: DemoOptions, served: ServedModel | None) -> int:
    return options.max_prompt if served is None else REAL_MAX_PROMPT


def _examples(workload: Sequence[DemoRequest], pair: EmbeddedPair,
              served: ServedModel | None, count: int = 4) -> list[tuple[str, str]]:
    """A few served questions with their answers, as text."""
    if served is None:
        return []
    out: list[tuple[str, str]] = []
    for req in workload:
        answer = pair.decode_responses.get(req.rid)
        if req.text and answer is not None and answer.ok and len(out) < count:
            out.append((req.text, served.decode(answer.output_ids).strip()))
    return out


def _serve(
    pair: EmbeddedPair, workload: Sequence[DemoRequest], progress: Progress, timeout_s: float
) -> float:
    """Drive the pair until every request has its answers; returns the seconds it took."""
    aborts = {r.rid: r.abort_in for r in workload if r.abort_in is not None}
    num_decode = sum(r.disaggregated for r in workload)
    answered = 0
    start = time.perf_counter()
    for r in workload:
        if r.disaggregated:
            pair.submit(r.rid, r.prompt, r.sampling)
        else:
            pair.prefill.submit(NewRequest(
                r.rid, r.prompt, bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=r.room,
                sampling=r.sampling,
            ))
    by_rid = {r.rid: r for r in workload}
    while True:
        step_or_rest(pair.step)
        for rid, target in list(aborts.items()):
            if rid in pair.prefill_responses:  # it ended first; the summary lists it as unplanned
                del aborts[rid]
                continue
            rec = pair.prefill.lifecycle.get(rid)
            if rec is not None and rec.state is not None and rec.state >= target:
                pair.abort(rid)
                del aborts[rid]
        responses = pair.prefill_responses
        if len(responses) > answered:
            # A PD router aborts on decode what failed on prefill, or decode waits for KV
            # that never comes (aborted requests were aborted on both sides already).
            for resp in list(responses.values())[answered:]:
                req = by_rid[resp.rid]
                if not resp.ok and req.disaggregated and req.abort_in is None:
                    pair.decode.abort(resp.rid, peer=resp.refusal())
            answered = len(responses)
        elapsed = time.perf_counter() - start
        progress.serving(pair.prefill.lifecycle, pair.decode.lifecycle, elapsed)
        if (
            answered == len(workload)
            and len(pair.decode_responses) == num_decode
            and pair.idle()
        ):
            return elapsed
        if elapsed > timeout_s:
            raise DemoTimeout(
                f"after {timeout_s:g} s, {len(workload) - answered} of {len(workload)} requests "
                f"have no prefill answer and {num_decode - len(pair.decode_responses)} no decode "
                f"answer"
            )


def _unplanned(workload: Sequence[DemoRequest], pair: EmbeddedPair) -> list[str]:
    out = []
    for req in workload:
        resp = pair.prefill_responses[req.rid]
        got = "done" if resp.ok else resp.reason.value if resp.reason else resp.state.name
        if got != req.expected:
            out.append(f"{req.rid}: planned {req.expected}, prefill ended {got} ({resp.detail})")
            continue
        dec = pair.decode_responses.get(req.rid)
        if req.expected == "done" and (dec is None or not dec.ok):
            detail = dec.detail if dec is not None else "no answer"
            out.append(f"{req.rid}: prefill done, decode did not finish ({detail})")
    return out


def _verify(
    workload: Sequence[DemoRequest], pair: EmbeddedPair, reference: Reference, progress: Progress
) -> tuple[int, list[Mismatch]]:
    served = [
        r for r in workload
        if (d := pair.decode_responses.get(r.rid)) is not None and d.ok
    ]
    mismatches = []
    for i, req in enumerate(served):
        progress.verifying(i, len(served))
        want = list(reference(pair.model, req))
        got = list(pair.decode_responses[req.rid].output_ids)
        first = pair.prefill_responses[req.rid].first_token
        if got != want or (got and first != got[0]):
            mismatches.append(Mismatch.of(req.rid, want, got, first))
    progress.verifying(len(served), len(served))
    return len(served), mismatches


def _kv_moved(pair: EmbeddedPair) -> tuple[float, float | None]:
    """KV bytes moved, and seconds the copies took where the backend measures them (local)."""
    if isinstance(pair.prefill_kv, LocalKVManager):
        stats = pair.prefill_kv.stats()
        return float(stats.bytes), stats.copy_seconds
    sent = pair.prefill.metrics.registry.get_sample_value("pdlife_transfer_bytes_total")
    return float(sent or 0.0), None


def run_demo(
    options: DemoOptions,
    *,
    reference: Reference = colocated_reference,
    console: Console | None = None,
    served: ServedModel | None = None,
) -> DemoResult:
    """Serve the workload of ``options``, check it, print the summary and write the outputs.
    ``served`` is ``options.model`` already loaded (else it is loaded here)."""
    console = console or Console()
    plan = fault_plan(options.seed)
    if served is None and options.model != REFERENCE:
        console.print(f"pdlife demo: loading {options.model} ...", soft_wrap=True)
        served = load_model(options.model)
    workload = make_workload(options.requests, options.seed, plan,
                             _max_prompt(options, served), served)
    delayer = PrefillDelayer(
        DelayerConfig(), StaticGather(), dp_size=1, attn_tp_size=1, enable_dp_attention=False
    )
    console.print(
        f"pdlife demo: {options.requests} requests ({sum(len(r.prompt) for r in workload)} "
        f"prompt tokens), model {options.model}, backend {options.backend}, {options.loop} loop, "
        f"seed {options.seed}",
        soft_wrap=True,
    )
    console.print(planned_line(workload), highlight=False, soft_wrap=True)
    pair = _make_pair(options, plan, delayer, served)
    with Progress(console, total=len(workload)) as progress:
        try:
            seconds = _serve(pair, workload, progress, options.timeout_s)
        finally:
            # Before the check: the reference run should not compete with transfer threads.
            pair.close()
        problems = _unplanned(workload, pair)
        for check in (pair.prefill.check_invariants, pair.decode.check_invariants):
            try:
                check()
            except AssertionError as exc:
                problems.append(f"invariant violated at the end of the run: {exc}")
        checked, mismatches = _verify(workload, pair, reference, progress)
    kv_bytes, kv_copy_seconds = _kv_moved(pair)
    tokens = pair.prefill.metrics.registry.get_sample_value("pdlife_prefill_tokens_total")
    data = RunData(
        requests=options.requests, backend=options.backend, loop=options.loop,
        seed=options.seed, workload=workload, prefill=dict(pair.prefill_responses),
        decode=dict(pair.decode_responses), serve_seconds=seconds,
        prefill_tokens=int(tokens or 0), kv_bytes=kv_bytes, kv_copy_seconds=kv_copy_seconds,
        delayer_outcomes=dict(delayer.outcomes), checked=checked, mismatches=mismatches,
        problems=problems, examples=_examples(workload, pair, served), model=options.model,
    )
    summary = finish_report(data, options.out, console)
    return DemoResult(0 if data.passed else 1, summary, options.out)
