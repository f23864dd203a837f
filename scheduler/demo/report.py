"""What ``pdlife demo`` shows and writes: the live progress, the summary, the output files.

Everything here reads a finished run (:class:`RunData`) or a lifecycle's counts; nothing drives a
request. The per-request parts of the report (TTFT phases, where each abort landed, the trace)
are replayed from the timelines the answers carry (:mod:`lifecycle.timeline`). The summary is one
JSON-ready dict, printed as tables and written to ``summary.json`` next to the lifecycle diagrams
and the Perfetto trace.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lifecycle import DECODE_TABLE, PREFILL_TABLE, Lifecycle
from lifecycle.diagram import DiagramError, render
from lifecycle.timeline import records, to_perfetto, ttft_phases
from scheduler.demo.records import DemoRequest, RunData
from scheduler.messages import DecodeResponse, Response

logger = logging.getLogger(__name__)

PHASES = ("bootstrap_wait", "queue_wait", "forward", "transfer", "total")
_PREFILL_PID, _DECODE_PID = 1, 2


# -- live progress --------------------------------------------------------------------------


def _by_state(lifecycle: Lifecycle[Any]) -> dict[str, int]:
    """Live counts per state, then finished counts per final state, in table order."""
    counts = {s.name: n for s, n in lifecycle.counts().items()}
    ended: Counter[str] = Counter()
    for (state, _reason), n in lifecycle.finished.items():
        ended[state.name] += n
    for state in lifecycle.table.states:
        if state in lifecycle.table.finals:
            counts[state.name] = ended[state.name]
    return counts


class Progress:
    """Requests by state while the run goes: a redrawn table on a terminal, otherwise a plain
    line every few seconds (and one when everything is answered)."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self._live = (
            Live(console=console, auto_refresh=False, transient=True)
            if console.is_terminal else None
        )
        self._interval = 0.1 if self._live is not None else 2.0
        self._next = 0.0
        self._ended = False

    def __enter__(self) -> Progress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()

    def serving(
        self, prefill: Lifecycle[Any], decode: Lifecycle[Any], elapsed: float
    ) -> None:
        answered = sum(prefill.finished.values())
        ended = answered == self.total and len(decode) == 0
        now = time.monotonic()
        if (now < self._next and not ended) or self._ended:
            return
        self._next = now + self._interval
        self._ended = ended
        sides = {"prefill": _by_state(prefill), "decode": _by_state(decode)}
        head = f"{elapsed:6.1f} s  {answered}/{self.total} answered by prefill"
        if self._live is None:
            parts = [
                f"{side}: " + " ".join(f"{k}={v}" for k, v in counts.items())
                for side, counts in sides.items()
            ]
            self.console.print(f"[{head}]  " + "  |  ".join(parts), highlight=False,
                               soft_wrap=True)
            return
        tables = []
        for side, counts in sides.items():
            t = Table(title=None, box=None, padding=(0, 1))
            t.add_column(side, style="bold")
            for name in counts:
                t.add_column(name, justify="right")
            t.add_row("", *(str(v) for v in counts.values()))
            tables.append(t)
        self._live.update(Group(Text(head), *tables), refresh=True)

    def verifying(self, done: int, total: int) -> None:
        text = f"checking outputs against the colocated reference: {done}/{total}"
        if self._live is not None:
            self._live.update(Text(text), refresh=True)
        elif done == 0 or done * 4 // total != (done - 1) * 4 // total:  # each quarter
            self.console.print(text, highlight=False, soft_wrap=True)


# -- the summary ----------------------------------------------------------------------------


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (small rates must not round to zero)."""
    return float(f"{x:.{digits}g}")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _outcomes(answers: Iterable[Response | DecodeResponse]) -> dict[str, Any]:
    done = 0
    failed: Counter[str] = Counter()
    for a in answers:
        if a.ok:
            done += 1
        else:
            failed[a.reason.value if a.reason is not None else a.state.name.lower()] += 1
    return {"done": done, "failed": dict(sorted(failed.items()))}


def _ttft_ms(answers: Iterable[Response]) -> dict[str, dict[str, float]]:
    phases = [ttft_phases(a.timeline) for a in answers if a.ok]
    out = {}
    for name in PHASES:
        values = [v * 1e3 for p in phases if (v := getattr(p, name)) is not None]
        if values:
            out[name] = {"p50": round(percentile(values, 50), 3),
                         "p99": round(percentile(values, 99), 3), "n": len(values)}
    return out


def _aborts(data: RunData) -> list[dict[str, Any]]:
    out = []
    for req in data.workload:
        if req.abort_in is None:
            continue
        steps = records(data.prefill[req.rid], PREFILL_TABLE)
        landed = next((s.source.name for s in steps if s.event == "abort"), None)
        chunks = sum(1 for s in steps if s.event == "chunk_done")
        out.append({"rid": req.rid, "target": req.abort_in.name, "landed_in": landed,
                    "chunks_done_before": chunks})
    return out


_PLANNED = {"bootstrap_failed": ("injected bootstrap failure", "injected bootstrap failures"),
            "transfer_failed": ("injected transfer failure", "injected transfer failures"),
            "aborted": ("abort mid-flight", "aborts mid-flight")}


def planned_line(workload: Sequence[DemoRequest]) -> str:
    """What the run is meant to show: how many requests are served, and how many end otherwise
    on purpose (the fake backend's injected faults, the aborts), which decode never serves."""
    planned = Counter(r.expected for r in workload)
    served = planned.pop("done", 0)
    if not planned:
        return f"planned: all {served} served"
    ends = ", ".join(f"{n} {_PLANNED.get(k, (k, k))[n != 1]}"
                     for k, n in sorted(planned.items()))
    return (f"planned: {served} served; on purpose, {ends} (the failures below are these; "
            "the run checks that each ends as planned)")


def build_summary(data: RunData) -> dict[str, Any]:
    """The summary of a run, JSON-ready (``summary.json`` holds it, plus the file list)."""
    secs = data.serve_seconds
    decode_tokens = sum(len(d.output_ids) for d in data.decode.values() if d.ok)
    planned = Counter(r.expected for r in data.workload)
    throughput: dict[str, Any] = {
        "prefill_tokens": data.prefill_tokens,
        "prefill_tokens_per_s": _sig(data.prefill_tokens / secs),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": _sig(decode_tokens / secs),
        "kv_bytes": int(data.kv_bytes),
        "kv_gb_per_s": _sig(data.kv_bytes / secs / 1e9),
    }
    if data.kv_copy_seconds:
        throughput["kv_copy_gb_per_s"] = _sig(data.kv_bytes / data.kv_copy_seconds / 1e9)
    return {
        "run": {"requests": data.requests, "backend": data.backend, "loop": data.loop,
                "seed": data.seed, "model": data.model, "serve_seconds": round(secs, 3)},
        "examples": [{"prompt": p, "answer": a} for p, a in data.examples],
        "planned": dict(sorted(planned.items())),
        "prefill": _outcomes(data.prefill.values()),
        "decode": _outcomes(data.decode.values()),
        "aborts": _aborts(data),
        "ttft_ms": _ttft_ms(data.prefill.values()),
        "throughput": throughput,
        "delayer_outcomes": dict(sorted(data.delayer_outcomes.items())),
        "verification": {
            "checked": data.checked,
            "matched": data.checked - len(data.mismatches),
            "mismatches": [attrs.asdict(m) for m in data.mismatches],
        },
        "problems": list(data.problems),
        "passed": data.passed,
    }


# -- the files ------------------------------------------------------------------------------


def trace(prefill: Sequence[Response], decode: Sequence[DecodeResponse]) -> dict[str, Any]:
    """One Chrome-trace/Perfetto object from the answers' timelines: process "prefill" and
    process "decode", one track per request in each, on one time axis (the earliest admission
    on either side is zero)."""
    sides = [(pid, answers, table) for pid, answers, table in (
        (_PREFILL_PID, prefill, PREFILL_TABLE), (_DECODE_PID, decode, DECODE_TABLE)
    ) if any(a.timeline for a in answers)]
    if not sides:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(a.timeline[0][0] for _, answers, _ in sides for a in answers if a.timeline)
    events: list[dict[str, Any]] = []
    for pid, answers, table in sides:
        for ev in to_perfetto(answers, table=table, pid=pid, origin=origin)["traceEvents"]:
            if ev["name"] == "process_name":
                ev = {**ev, "args": {"name": f"pdlife {table.name}"}}
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_files(data: RunData, out: Path) -> dict[str, list[str]]:
    """The lifecycle diagrams (mermaid; SVG when Graphviz's ``dot`` is on PATH) and the trace,
    written into ``out``; returns the written paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {"diagram_mermaid": [], "diagram_svg": []}
    for table in (PREFILL_TABLE, DECODE_TABLE):
        path = out / f"lifecycle-{table.name}.mmd"
        path.write_text(render(table, "mermaid"), encoding="utf-8")
        files["diagram_mermaid"].append(str(path))
        if shutil.which("dot"):
            try:
                svg = render(table, "svg")
            except DiagramError as exc:  # e.g. the graphviz Python package is missing
                logger.warning("no SVG diagram: %s", exc)
                continue
            path = out / f"lifecycle-{table.name}.svg"
            path.write_text(svg, encoding="utf-8")
            files["diagram_svg"].append(str(path))
    path = out / "trace.json"
    # Tracks in submission order, each side.
    perfetto = trace([data.prefill[r.rid] for r in data.workload],
                     [data.decode[r.rid] for r in data.workload if r.rid in data.decode])
    path.write_text(json.dumps(perfetto), encoding="utf-8")
    files["trace"] = [str(path)]
    files["summary"] = [str(out / "summary.json")]
    return files


# -- printing -------------------------------------------------------------------------------


_DELAYER_MEANING = {
    "no_wait": "prefill allowed, no delay before it",
    "wait_success": "prefill allowed after a delay",
    "wait_timeout": "prefill allowed: the delay ran out",
    "token_watermark": "prefill allowed: KV usage below the low watermark",
    "delay": "prefill held back this pass",
    "none": "nothing to prefill this pass",
}


def _table(*columns: str) -> Table:
    t = Table()
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    return t


def _show(console: Console, title: str, table: Table) -> None:
    # A separate heading: a table's own title wraps at the table's width.
    console.print(Text(title, style="bold"), soft_wrap=True)
    console.print(table)


def render_summary(summary: dict[str, Any], console: Console) -> None:
    outcomes = _table("side", "state", "reason", "requests")
    outcomes.columns[1].justify = outcomes.columns[2].justify = "left"
    for side in ("prefill", "decode"):
        o = summary[side]
        outcomes.add_row(side, "DONE", "", str(o["done"]))
        for reason, n in o["failed"].items():
            outcomes.add_row(side, "FAILED", reason, str(n))
    _show(console, "Requests by final state and reason", outcomes)
    if summary["aborts"]:
        aborts = _table("request", "aimed at", "landed in", "chunks before")
        aborts.columns[1].justify = aborts.columns[2].justify = "left"
        for a in summary["aborts"]:
            aborts.add_row(a["rid"], a["target"], str(a["landed_in"]),
                           str(a["chunks_done_before"]))
        _show(console, "Aborts (prefill state when the abort took effect)", aborts)
    ttft = _table("phase", "p50", "p99", "requests")
    for name, v in summary["ttft_ms"].items():
        ttft.add_row(name, f"{v['p50']:.1f}", f"{v['p99']:.1f}", str(v["n"]))
    _show(console, "TTFT phases of served requests, ms (from the prefill timelines)", ttft)
    t = summary["throughput"]
    rates = _table("measure", "value")
    rates.add_row("prefill tokens/s", f"{t['prefill_tokens_per_s']:,.0f}")
    rates.add_row("decode tokens/s", f"{t['decode_tokens_per_s']:,.0f}")
    rates.add_row("KV moved, MB", f"{t['kv_bytes'] / 1e6:,.1f}")
    rates.add_row("KV GB/s over the run", f"{t['kv_gb_per_s']:.3g}")
    if "kv_copy_gb_per_s" in t:
        rates.add_row("KV GB/s while copying", f"{t['kv_copy_gb_per_s']:.3g}")
    _show(console, f"Throughput over {summary['run']['serve_seconds']:.1f} s of serving", rates)
    delayer = _table("reason", "passes", "meaning")
    delayer.columns[2].justify = "left"
    for reason, n in summary["delayer_outcomes"].items():
        delayer.add_row(reason, str(n), _DELAYER_MEANING.get(reason, ""))
    _show(console, "PrefillDelayer outcomes (one decision per pass)", delayer)
    if summary["examples"]:
        examples = _table("prompt", "answer (served disaggregated)")
        examples.columns[0].justify = examples.columns[1].justify = "left"
        for e in summary["examples"]:
            examples.add_row(e["prompt"], e["answer"])
        _show(console, f"Some answers of {summary['run']['model']}", examples)


def finish_report(data: RunData, out: Path, console: Console) -> dict[str, Any]:
    """Print the summary and the verdict, write every output into ``out``; returns the summary."""
    summary = build_summary(data)
    summary["files"] = write_files(data, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    render_summary(summary, console)
    v = summary["verification"]
    if data.mismatches:
        console.print(f"[bold red]FAILED[/]: {len(data.mismatches)} of {v['checked']} outputs "
                      f"differ from the colocated reference:")
        for m in data.mismatches:
            console.print(f"  {m.describe()}", highlight=False)
    else:
        checked = v["checked"]
        console.print("[bold green]ok[/]: " + (
            f"all {checked} served outputs equal" if checked != 1 else "the served output equals")
            + " the colocated reference, token for token")
    if not data.problems:
        others = sum(n for k, n in summary["planned"].items() if k != "done")
        if others:
            console.print(f"[bold green]ok[/]: the {others} planned failures and aborts ended "
                          "as planned")
    if data.problems:
        console.print(f"[bold red]FAILED[/]: {len(data.problems)} requests did not end as "
                      f"planned:")
        for p in data.problems:
            console.print(f"  {p}", highlight=False, markup=False)
    console.print(f"outputs in {out}/: lifecycle diagrams, trace.json (open it in "
                  f"https://ui.perfetto.dev), summary.json", highlight=False, soft_wrap=True)
    return summary
