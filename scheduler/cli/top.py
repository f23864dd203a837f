"""``pdlife top URL [URL ...]``: running workers, live in the terminal.

Each refresh reads every worker's ``/server_info`` and ``/metrics`` at once (one thread per
worker, each with ``--timeout``), computes the view (:mod:`.top_view`) and redraws one table,
a column per worker. A worker that cannot be read says why in its column; the others go on.
Ctrl-C ends it, exit status 0. ``--once`` prints one table (two scrapes ``--interval`` apart, so
rates exist) and exits 1 if a worker was unreachable, for scripts. Workers started with an API
key are read with the key in ``PDLIFE_API_KEY``.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from scheduler.cli.command import Subcommand, UsageError
from scheduler.cli.credentials import API_KEY_ENV, api_key

if TYPE_CHECKING:
    import httpx
    from rich.table import Table

    from scheduler.cli.top_view import History, ReplicaView, WorkerView


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="+", metavar="URL",
                        help="a worker's base URL (http://host:port, or host:port), as pdlife "
                        "serve prints it; several for a prefill/decode fleet")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help="seconds between refreshes (default: %(default)s)")
    parser.add_argument("--iterations", type=int, default=0, metavar="N",
                        help="stop after N refreshes; 0 runs until Ctrl-C (default: 0)")
    parser.add_argument("--once", action="store_true",
                        help="print one table and exit, without the live screen (two scrapes "
                        "--interval apart, so rates exist); exit status 1 if a worker was "
                        "unreachable")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS",
                        help="how long one worker may take to answer, per request "
                        "(default: %(default)s)")


def _url(text: str) -> str:
    import httpx

    url = (text if "://" in text else f"http://{text}").rstrip("/")
    try:
        parsed = httpx.URL(url)
        good = (parsed.scheme in ("http", "https") and parsed.host
                and (parsed.port is None or 0 < parsed.port < 65536))
        problem = "" if good else "not an http(s) URL with a host and a port in 1..65535"
    except httpx.InvalidURL as exc:
        problem = str(exc)
    if problem:
        raise UsageError(f"{text!r} is not a worker's address ({problem}); give HOST:PORT or "
                         "http://HOST:PORT")
    return url


def _scrape(client: httpx.Client, history: History) -> WorkerView:
    """One worker read once (its view, or why it could not be read)."""
    import httpx

    from scheduler.cli.top_view import Scrape, parse_metrics

    try:
        info = client.get(f"{history.url}/server_info")
        info.raise_for_status()
        metrics = client.get(f"{history.url}/metrics")
        metrics.raise_for_status()
        scrape = Scrape(time.monotonic(), info.json(), parse_metrics(metrics.text))
    except httpx.HTTPStatusError as exc:
        hint = f" (the worker wants an API key: set {API_KEY_ENV})" if (
            exc.response.status_code == 401) else ""
        return history.unreachable(f"{exc.request.url.path} answered "
                                   f"{exc.response.status_code}{hint}")
    except httpx.HTTPError as exc:
        return history.unreachable(f"unreachable ({type(exc).__name__}: {exc or 'no answer'})")
    except ValueError as exc:  # not JSON, not Prometheus text
        return history.unreachable(f"unreadable answer ({exc})")
    return history.add(scrape)


def _refresh(pool: ThreadPoolExecutor, client: httpx.Client,
             histories: Sequence[History]) -> list[WorkerView]:
    return list(pool.map(lambda h: _scrape(client, h), histories))


# -- the table --------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _per_s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}/s"


def _bytes_per_s(value: float | None) -> str:
    if value is None:
        return "—"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B/s"


def _used(used: int, total_: int) -> str:
    return f"{used}/{total_} ({used / total_:.0%})" if total_ else "—"


def _replica(replica: ReplicaView) -> str:
    """A DP replica's line: its live requests, pool and slots, and whether it answered."""
    if replica.live is None or replica.kv_pool is None:
        line, age = f"dp{replica.rank}: no figures yet", ""
    else:
        slots = "" if replica.slots is None else f", slots {replica.slots[0]}/{replica.slots[1]}"
        line = f"dp{replica.rank}: {replica.live} live, KV {_used(*replica.kv_pool)}{slots}"
        age = "" if replica.age_s is None else f" (figures {replica.age_s:.0f} s old)"
    return line if replica.answered else f"{line}, [bold red]not answering[/]{age}"


def _cells(view: WorkerView) -> list[str]:
    """A worker's column, one cell per row of :data:`_ROWS`."""
    if view.error is not None:
        return [f"[bold red]{view.error}[/]"] + ["—"] * (len(_ROWS) - 1)
    status = "[green]healthy[/]" if view.healthy else "[bold red]unhealthy[/]"
    if view.draining:
        status += ", [yellow]draining[/]"
    requests = "\n".join(
        f"{side}: " + (", ".join(f"{state} {n}" for state, n in states.items()) or "none")
        for side, states in view.requests.items())
    hits = "" if view.prefix_hit_rate is None else f", {view.prefix_hit_rate:.0%} hit"
    pools = "\n".join(
        f"{side}: {_used(used, total_)}"
        + (f", prefix cache {view.prefix_cache_pages[side]}{hits}"
           if side in view.prefix_cache_pages else "")
        for side, (used, total_) in view.kv_pool.items())
    failures, refusals = (", ".join(f"{r} {n}" for r, n in counts.items()) or "none"
                          for counts in (view.failures, view.refusals))
    slots = "—" if view.slots is None else f"{view.slots[0]}/{view.slots[1]}"
    worker = f"{view.role}, {status}" + (f"\n{view.layout}" if view.layout else "")
    replicas = "\n".join(map(_replica, view.replicas))
    return [worker, requests or "—", _per_s(view.admissions_per_s),
            _per_s(view.completions_per_s), failures, refusals,
            f"{_ms(view.ttft_p50)} / {_ms(view.ttft_p99)}", pools or "—", slots,
            _bytes_per_s(view.transfer_bytes_per_s), replicas or "—"]


# The last row, each DP replica of a prefill worker, is shown when a worker has several.
_ROWS = ("worker", "requests by state", "admitted", "completed", "failures (total)",
         "refused (total)",
         "TTFT p50 / p99 (1 min)", "KV pool used", "metadata slots", "KV sent", "DP replicas")


def render(views: Sequence[WorkerView], refreshed: str = "") -> Table:
    """The table of ``views``: a row per quantity, a column per worker (the DP replicas' row
    only when a worker has several)."""
    from rich.table import Table

    table = Table(title=f"pdlife top {refreshed}".rstrip(),
                  caption="Ctrl-C to quit" if refreshed else None, show_lines=True)
    table.add_column("", style="bold")
    for view in views:
        table.add_column(view.url, overflow="fold")
    columns = [_cells(v) for v in views]
    rows = _ROWS if any(v.replicas for v in views) else _ROWS[:-1]
    for i, name in enumerate(rows):
        table.add_row(name, *(c[i] for c in columns))
    return table


# -- the command ------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    from scheduler.cli.top_view import History

    for flag, value, least in (("--interval", args.interval, 0), ("--timeout", args.timeout, 0),
                               ("--iterations", args.iterations, -1)):
        if not value > least:  # NaN too
            raise UsageError(f"{flag} must be {'>= 0' if least < 0 else '> 0'}, got {value}")
    histories = [History(_url(u)) for u in args.urls]
    console = Console()
    # Ctrl-C sets this event instead of raising KeyboardInterrupt wherever the main thread is
    # (a KeyboardInterrupt inside the executor's or httpx's locking can hang the exit): the
    # loop ends at its next check, and the wait between refreshes ends at once.
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: stop.set())
    key = api_key(None)
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=args.timeout, headers=headers) as client, ThreadPoolExecutor(
            len(histories), thread_name_prefix="pdlife-top") as pool:
        try:
            if args.once:
                _refresh(pool, client, histories)
                stop.wait(args.interval)
                views = _refresh(pool, client, histories)
                console.print(render(views))
                return 1 if any(v.error is not None for v in views) else 0
            with Live(console=console, auto_refresh=False) as live:
                done = 0
                while not stop.is_set():
                    views = _refresh(pool, client, histories)
                    live.update(render(views, time.strftime("%H:%M:%S")), refresh=True)
                    done += 1
                    if done == args.iterations:
                        break
                    stop.wait(args.interval)
        finally:
            signal.signal(signal.SIGINT, previous)
    return 0


TOP = Subcommand(
    name="top",
    summary="watch running workers live: requests by state, rates, failures, TTFT, KV usage",
    description=(
        "A live view of pdlife serve workers (prefill, decode or local), refreshed every "
        "--interval seconds from their /server_info and /metrics: requests per lifecycle state, "
        "admissions and completions per second, failures and refusals by reason, TTFT p50/p99 "
        "over the last minute (prefill workers), KV pool and metadata-slot usage, KV bytes sent "
        "per second; a prefill of several DP replicas shows the whole server's figures and a "
        "line per replica. A worker that cannot be read says why in its column. Ctrl-C quits."
    ),
    epilog=(
        "Example: pdlife top 127.0.0.1:30000 127.0.0.1:30001. Workers that require an API "
        f"key are read with ${API_KEY_ENV}. Rates and TTFT need two "
        "refreshes; TTFT comes from pdlife_ttft_seconds, which only prefill workers (and "
        "--backend local) have. For history and alerts scrape the same /metrics with "
        "Prometheus (docs/operations.md)."
    ),
    add_arguments=_arguments,
    run=_run,
)
