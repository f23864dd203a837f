"""``pdlife serve``: an SGLang-compatible prefill or decode worker.

The model flags are ``pdlife generate``'s too (:mod:`scheduler.cli.model_flags`), so a served
output and the colocated run agree token for token when started alike.

Shutdown: the first SIGTERM or SIGINT starts a drain (``/generate`` and ``/health`` answer 503,
requests in flight finish; with ``--drain-linger`` the server goes on refusing new ones for that
long), then the server exits 0; after ``--drain-timeout`` seconds what is
still live is aborted and the exit status is 3, so a supervisor can tell. A failed engine loop
exits 1. A second SIGINT exits at once. Once the backends are closed the process ends without
the interpreter's slow teardown (torch's, the transfer engine's), so an idle server exits
promptly.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import re
import socket
import sys
import tempfile
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from kv.pool_layout import DEFAULT_KV_LAYOUT, KV_LAYOUTS
from scheduler.cli.command import Subcommand, UsageError
from scheduler.cli.credentials import API_KEY_ENV, PEER_TOKEN_ENV, api_key, peer_token
from scheduler.cli.model_flags import (
    REFERENCE_NAME,
    add_model_arguments,
    check_device,
    load_served,
    model_config,
)
from scheduler.cli.open_files import raise_open_files_limit
from scheduler.service import logs
from scheduler.service.logs import FORMATS, LEVELS, LogSettings
from scheduler.service.tool_formats import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from scheduler.service.config import Role, ServeConfig
    from scheduler.service.decode_ranks import DecodeRanks
    from scheduler.service.ranks import Ranks

logger = logging.getLogger(__name__)

#: Exit status of a server whose drain had to abort requests at ``--drain-timeout``.
EXIT_DRAIN_ABORTED = 3
#: Exit status of a server whose engine loop failed.
EXIT_ENGINE_FAILED = 1
#: Exit status of bad input: a flag refused, or the HTTP port not listened on.
EXIT_USAGE = 2

_SIZE = re.compile(r"\s*(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10,
          "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _size(n: int) -> str:
    """``n`` bytes as :func:`byte_size` reads them: in the largest binary unit that divides it."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


def byte_size(text: str) -> int:
    """A size in bytes: a plain number, or one with a unit (``64KiB``, ``8MiB``, ``1GB``)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (bytes, or a number with B, KB, MB, GB, TB, KiB, MiB, GiB "
            "or TiB)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


#: The flags that take a plain number, by group: flag -> what it sets. The default
#: (:func:`flag_defaults`, else :data:`_OWN_DEFAULTS`) gives the flag its type.
_NUMBERS: dict[str, dict[str, str]] = {
    "scheduling and memory": {
        "--page-size": "tokens per KV page",
        "--metadata-slots": "metadata rows, i.e. requests between bootstrap and transfer",
        "--chunked-prefill-size": "tokens per prefill chunk, 0 to disable chunking",
        "--max-prefill-tokens": "tokens per prefill batch",
        "--max-running-requests": "requests holding KV pages at once",
    },
    "timeouts and limits": {
        "--bootstrap-timeout": "prefill: seconds to wait for decode's destination",
        "--transfer-timeout": "prefill: seconds for a transfer to conclude",
        "--waiting-timeout": "decode: seconds a request may wait, from admission, for its "
                             "pages and then its KV",
        "--connect-timeout": "decode: seconds to look a prefill server up",
        "--retire-lost-prefill-after": "decode, mooncake: seconds a prefill server may count as "
                                       "gone (its heartbeat failing) before the transfer engine "
                                       "kept for it closes; 0 keeps it",
        "--drain-timeout": "on SIGTERM: seconds to let requests finish before aborting them",
        "--drain-linger": "on SIGTERM, once drained (or the drain timed out): seconds to go on "
                          "answering, refusing new requests (503 draining, refused to their "
                          "peers too), before the port closes; set it to the router's "
                          "health-check interval times its failure threshold, so the router "
                          "stops sending requests here first",
    },
}
#: The defaults of the flags that set no configuration field: the server's own behaviour.
_OWN_DEFAULTS: dict[str, int | float] = {"--drain-timeout": 60.0, "--drain-linger": 0.0}


def flag_defaults() -> dict[str, Any]:
    """The default of every flag that sets a configuration field: that field's default, read
    from the configuration class (in the flag's unit), so that a flag and its field cannot
    drift apart."""
    # Imported here: only the serve command's parser needs the KV layer (the other commands
    # start without it).
    from kv.mooncake_engine import MooncakeConfig
    from scheduler.prefill.config import SchedulerConfig
    from scheduler.prefill.delayer_decision import DelayerConfig
    from scheduler.service.config import ServeConfig

    sched, serve, mc, delayer, log = ({f.name: f.default for f in attrs.fields(c)} for c in (
        SchedulerConfig, ServeConfig, MooncakeConfig, DelayerConfig, LogSettings))
    retire = mc["retire_lost_after_s"]
    return {
        "--page-size": sched["page_size"],
        "--metadata-slots": serve["metadata_slots"],
        "--chunked-prefill-size": sched["chunked_prefill_size"] or 0,  # 0: None
        "--max-prefill-tokens": sched["max_prefill_tokens"],
        "--max-running-requests": sched["max_running_requests"],
        "--pool-pages": serve["pool_pages"],
        "--schedule-policy": sched["schedule_policy"],
        "--bootstrap-port": serve["bootstrap_port"],
        # It sets both (the scheduler's wait, the transfer engine's).
        "--bootstrap-timeout": sched["bootstrap_timeout"],
        "--transfer-timeout": sched["transfer_timeout"],
        "--waiting-timeout": serve["waiting_timeout"],
        "--connect-timeout": mc["connect_timeout_s"],
        "--retire-lost-prefill-after": 0.0 if retire is None else retire,  # 0: None
        "--lost-prefill-release-timeout": mc["lost_release_timeout_s"],
        "--max-body-bytes": serve["max_body_bytes"],
        "--stream-interval": serve["stream_interval"],
        "--mooncake-host": mc["hostname"],
        "--mooncake-protocol": mc["protocol"],
        "--mooncake-device": mc["device"],
        "--mooncake-block-mib": mc["max_block_bytes"] >> 20,
        "--mooncake-engines": mc["engines"],
        "--mooncake-tcp-lanes": mc["tcp_lanes"],
        "--prefill-delayer-max-delay-passes": delayer["max_delay_passes"],
        "--log-level": log["level"],
        "--log-format": log["format"],
    }


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a rank count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (0: the system picks one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0-65535, got {text!r}")
    return value


def _number_group(parser: argparse.ArgumentParser, title: str,
                  defaults: dict[str, Any]) -> argparse._ArgumentGroup:
    """The group ``title`` with its plain-number flags (:data:`_NUMBERS`) declared, each with
    its default in ``defaults`` (:func:`flag_defaults`) or :data:`_OWN_DEFAULTS`."""
    group = parser.add_argument_group(title)
    for flag, text in _NUMBERS[title].items():
        default = defaults.get(flag, _OWN_DEFAULTS.get(flag))
        assert isinstance(default, int | float), f"{flag} has no default"
        group.add_argument(flag, type=type(default), default=default,
                           help=f"{text} (default: {default:g})")
    return group


#: The parallel layout's flags (each a count of at least 1, 1 by default): flag -> what it counts.
_PARALLEL = {
    "--tp-size": "tensor-parallel ranks per pipeline stage, each a process holding its heads "
                 "(a real checkpoint loaded again in each); a decode server (mooncake) runs "
                 "on TP ranks only",
    "--pp-size": "pipeline stages, each holding a range of the layers (reference model)",
    "--dp-size": "data-parallel replicas behind one bootstrap port, each a TP x PP mesh with its "
                 "own scheduler; a request goes to replica bootstrap_room %% dp-size",
}


#: Where spans go with --enable-trace and no --otlp-traces-endpoint (SGLang's default).
DEFAULT_OTLP_ENDPOINT = "localhost:4318"

def _defaulted(group: argparse._ActionsContainer, flag: str, default: str | int, text: str,
               **how: Any) -> None:
    """A flag whose help ends with its default, as a number's does (``how``: add_argument's
    other keywords)."""
    group.add_argument(flag, default=default, help=f"{text} (default: {default})", **how)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = flag_defaults()
    parser.add_argument("--role", choices=("prefill", "decode"),
                        help="which side of PD serving: required with --backend mooncake or "
                        "fake, refused with --backend local (which runs both)")
    _defaulted(parser, "--backend", "mooncake",
               "KV transfer: mooncake (between processes), local (prefill and decode in this one "
               "process), fake (no transfer; the decode role computes prompts itself)",
               choices=("mooncake", "local", "fake"))
    _defaulted(parser, "--host", "127.0.0.1", "HTTP bind address")
    _defaulted(parser, "--port", 30000, "HTTP port", type=port_number)
    _defaulted(parser, "--bootstrap-port", defaults["--bootstrap-port"],
               "prefill role, mooncake: the bootstrap endpoint's port, on --host",
               type=port_number)
    parser.add_argument("--model-name", default=REFERENCE_NAME,
                        help="the name /model_info and /v1/models report (default: --model's "
                        f"value; {REFERENCE_NAME} for the reference model)")
    add_model_arguments(parser)
    parser.add_argument("--tool-call-parser", default=None, metavar="FORMAT",
                        choices=TOOL_CALL_PARSERS,
                        help="the format the model writes tool calls in, read for OpenAI's "
                        "tool_choice auto: hermes or qwen25 (<tool_call> blocks: Hermes, "
                        "Qwen 2.5), llama3 or llama3_json (JSON calls: Llama 3.1-3.3), mistral "
                        "([TOOL_CALLS]), pythonic ([f(x=1)]: Llama 3.2, 4) (default: none; auto "
                        "is refused, required and named functions are forced by a grammar)")
    sched = _number_group(parser, "scheduling and memory", defaults)
    _defaulted(sched, "--kv-layout", DEFAULT_KV_LAYOUT.value,
               "the KV pool's order: page_major (one transfer block per run of pages) or "
               "layer_major (SGLang's order of its tensors); prefill and decode must agree",
               choices=KV_LAYOUTS)
    pool = sched.add_mutually_exclusive_group()  # one way to size the pool
    _defaulted(pool, "--pool-pages", defaults["--pool-pages"], "KV pool pages per role",
               type=int)
    pool.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="SIZE",
                      help="size the KV pool by memory instead of --pool-pages (e.g. 2GiB), "
                      "per role: as many pages as fit, from the model's layers, KV heads, head "
                      "dim and dtype (a colocated worker's two pools take twice SIZE)")
    sched.add_argument("--max-new-tokens-limit", type=int, default=None,
                       help="largest max_new_tokens accepted (default: the model's max position)")
    sched.add_argument("--overlap", action="store_true",
                       help="prefill: launch the next batch before processing the previous one")
    sched.add_argument("--disable-radix-cache", action="store_true",
                       help="prefill: turn the prefix cache off, so every prompt is computed "
                       "in full (docs/prefix-cache.md)")
    _defaulted(sched, "--schedule-policy", defaults["--schedule-policy"],
               "prefill: the waiting queue's order, arrival (fcfs) or longest cached prefix "
               "first (lpm, needs the prefix cache)", choices=("fcfs", "lpm"))
    par = parser.add_argument_group("parallelism (prefill; docs/backends.md#parallel-layouts)")
    for flag, text in _PARALLEL.items():
        _defaulted(par, flag, 1, text, type=positive_int)
    par.add_argument("--enable-prefill-delayer", action="store_true",
                     help="prefill only, with --dp-size > 1: SGLang's PrefillDelayer, "
                          "negotiated across the DP replicas each pass, which keeps them in "
                          "lockstep (docs/delayer.md)")
    # None: not given (it goes with --enable-prefill-delayer); DelayerConfig's default then.
    passes = defaults["--prefill-delayer-max-delay-passes"]
    par.add_argument("--prefill-delayer-max-delay-passes", type=positive_int, default=None,
                     help="with --enable-prefill-delayer: while only some replicas have a "
                     "prefill to run, it is held back at most this value minus 1 passes in a "
                     f"row, so 1 never holds it (default: {passes}, {passes - 1} passes)")
    times = _number_group(parser, "timeouts and limits", defaults)
    release = defaults["--lost-prefill-release-timeout"]
    times.add_argument("--lost-prefill-release-timeout", type=float, default=release,
                       help="decode, mooncake: seconds a request's pages stay reserved, at "
                       "most, once its prefill server counted as gone, while a prefill rank "
                       "that has not said it stopped may still write into them (default: "
                       f"{release:g})")
    body = defaults["--max-body-bytes"]
    times.add_argument("--max-body-bytes", type=byte_size, default=body, metavar="SIZE",
                       help="largest request body accepted, in bytes or with a unit "
                       f"(65536, 64KiB, 8MiB) (default: {_size(body)})")
    mc = parser.add_argument_group("mooncake")
    _defaulted(mc, "--mooncake-host", defaults["--mooncake-host"],
               "this machine's address for the transfer engine and control sockets")
    _defaulted(mc, "--mooncake-protocol", defaults["--mooncake-protocol"],
               "the transfer engine's transport: tcp everywhere, rdma where the machine has "
               f"RDMA devices (refused where {RDMA_DEVICES} lists none)", choices=("tcp", "rdma"))
    mc.add_argument("--mooncake-device", default=defaults["--mooncake-device"],
                    help="rdma: the RDMA device(s) to use, comma-separated (e.g. mlx5_0) "
                    "(default: the transfer engine picks among them)")
    _defaulted(mc, "--mooncake-block-mib", defaults["--mooncake-block-mib"],
               "prefill: a run of pages longer than this many MiB is written as blocks of it "
               "(each block one stream, on tcp over one lane)", type=int)
    _defaulted(mc, "--mooncake-engines", defaults["--mooncake-engines"],
               "prefill: transfer engines a rank writes through, 1-16, its blocks dealt over "
               "them (over tcp at 4 lanes, two moved a round faster than one)", type=int)
    _defaulted(mc, "--mooncake-tcp-lanes", defaults["--mooncake-tcp-lanes"],
               "prefill, tcp: connections each engine keeps to a decode peer, 1-16, one block "
               "moving on each at a time", type=int)
    sec = parser.add_argument_group("security and overload (docs/security.md)")
    sec.add_argument("--peer-token-file", metavar="PATH",
                     help="mooncake: a file whose first line is the token prefill and decode "
                     "workers share; the bootstrap endpoint and every control message require "
                     f"it (default: ${PEER_TOKEN_ENV}, else none). Never on the command line")
    sec.add_argument("--allow-prefill", action="append", default=[], metavar="HOST:PORT",
                     help="decode, mooncake: a prefill server's bootstrap address requests may "
                     "name (repeat it, or give several comma-separated); a request naming "
                     "another is refused (400 bad_bootstrap) before this worker contacts it, "
                     "peer token and all (default: any address)")
    sec.add_argument("--api-key", metavar="KEY",
                     help="clients must send Authorization: Bearer KEY on every route but "
                     "/health and /health_generate (SGLang's flag; ps shows it: "
                     f"${API_KEY_ENV} gives it unseen) (default: none)")
    sec.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                     help="requests waiting for KV pages (the bootstrap wait counts) beyond "
                     "which new ones get 503 with Retry-After (default: no bound)")
    stream = parser.add_argument_group("streaming (docs/operations.md#streaming)")
    _defaulted(stream, "--stream-interval", defaults["--stream-interval"],
               "a stream's chunk goes out once this many tokens are new: the first token at "
               "once, the last with the answer (SGLang's flag; the OpenAI routes' chunks too)",
               type=positive_int, metavar="N")
    stream.add_argument("--incremental-streaming-output", action="store_true",
                        help="each /generate stream chunk carries only the text, output_ids "
                        "and logprob entries it adds, not the answer so far (SGLang's flag; "
                        "the OpenAI routes' chunks are that already)")
    obs = parser.add_argument_group("tracing (docs/operations.md#traces)")
    obs.add_argument("--enable-trace", action="store_true",
                     help="export an OpenTelemetry span tree per finished request (needs the "
                     "trace extra: pip install 'pdlife[trace]')")
    # None: not given (it goes with --enable-trace); localhost:4318 then.
    obs.add_argument("--otlp-traces-endpoint", default=None, metavar="HOST:PORT",
                     help="with --enable-trace: the collector's OTLP/HTTP endpoint, HOST:PORT "
                     "(spans go to /v1/traces there) or a full URL (default: localhost:4318)")
    _defaulted(parser, "--log-level", defaults["--log-level"],
               "the server's log level, its rank processes' too; debug adds an access log line "
               "per HTTP request", choices=LEVELS, type=str.lower)
    _defaulted(parser, "--log-format", defaults["--log-format"],
               "text (a line per record) or json (an object per line, for log collectors: "
               "time, level, logger, message, process, exception)", choices=FORMATS)


#: The SchedulerConfig fields that take their flag's value as it is (``--page-size`` sets
#: ``page_size``); the others are worked out in :func:`serve_config`.
_SCHEDULER_AS_GIVEN = ("page_size", "max_prefill_tokens", "max_running_requests",
                       "bootstrap_timeout", "transfer_timeout", "schedule_policy")
#: Likewise for the ServeConfig.
_SERVE_AS_GIVEN = ("backend", "metadata_slots", "waiting_timeout", "max_new_tokens_limit",
                   "max_body_bytes", "max_queued_requests", "kv_layout", "device", "overlap",
                   "tp_size", "pp_size", "dp_size", "stream_interval",
                   "incremental_streaming_output")


def _as_given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}


def _check_pool_fits(pool_bytes: int, *, pools: int) -> None:
    """Refuse KV pools larger than the memory this process may use (they are allocated,
    zeroed, at start: torch would fail with a traceback, or the kernel kill the process)."""
    total = memory_total()
    if total is not None and pool_bytes * pools > total:
        each = f" each, {pools} of them (prefill and decode)" if pools > 1 else ""
        raise UsageError(
            f"the KV pool takes {pool_bytes / (1 << 30):.1f} GiB{each}, more than the "
            f"{total / (1 << 30):.1f} GiB of memory this machine (or its container's memory "
            "limit) allows: lower --pool-pages or --kv-cache-memory (docs/models.md, Memory "
            "sizing)")


#: What a metadata slot holds, all its buffers together (kv.metadata.MetadataBuffers), in bytes.
_SLOT_BYTES = 1024


def _check_slots_fit(slots: int, *, pools: int) -> None:
    """Refuse more metadata slots than the memory this process may use holds (each side
    allocates its rows at start)."""
    total = memory_total()
    if total is not None and slots * _SLOT_BYTES * pools > total // 2:
        raise UsageError(f"--metadata-slots {slots} takes {slots * _SLOT_BYTES / (1 << 30):.1f} "
                         f"GiB a side, more than half the {total / (1 << 30):.1f} GiB of memory "
                         "this machine (or its container) allows: a slot is one request between "
                         "bootstrap and transfer, so give about --max-running-requests")


#: Where Linux says how much memory there is: the machine's, and a container's limit (cgroup
#: v2, then v1; "max" or a huge number where there is none).
_MEMINFO = "/proc/meminfo"
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_total() -> int | None:
    """The memory this process may use, in bytes: the machine's (``MemTotal``) or its
    container's limit, whichever is smaller; None where Linux does not say."""
    found: list[int] = []
    try:
        with open(_MEMINFO) as meminfo:
            found += [int(line.split()[1]) * 1024 for line in meminfo
                      if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as limit:
                found.append(int(limit.read().strip()))
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
    return min(found) if found else None


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The :class:`~scheduler.service.core.ServeConfig` the flags describe."""
    from kv.mooncake_engine import MooncakeConfig
    from scheduler.model.select import reference_kv_bytes_per_token
    from scheduler.prefill.config import SchedulerConfig
    from scheduler.prefill.delayer_decision import DelayerConfig
    from scheduler.service.core import ServeConfig

    check_device(args)
    if args.prefill_delayer_max_delay_passes is not None and not args.enable_prefill_delayer:
        raise UsageError("--prefill-delayer-max-delay-passes goes with --enable-prefill-delayer")
    if args.mooncake_block_mib < 1:
        raise UsageError(f"--mooncake-block-mib must be >= 1, got {args.mooncake_block_mib}")
    for flag, value in (("--mooncake-engines", args.mooncake_engines),
                        ("--mooncake-tcp-lanes", args.mooncake_tcp_lanes)):
        if not 1 <= value <= 16:
            raise UsageError(f"{flag} must be 1-16, got {value}")
    if args.retire_lost_prefill_after < 0:
        raise UsageError("--retire-lost-prefill-after must be >= 0 (0 keeps managers), got "
                         f"{args.retire_lost_prefill_after:g}")
    for flag in _NUMBERS["timeouts and limits"]:
        value = getattr(args, flag[2:].replace("-", "_"))
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number of seconds, got {value:g}")
    for flag, seconds in (("--drain-timeout", args.drain_timeout),
                          ("--drain-linger", args.drain_linger)):
        if seconds < 0:
            raise UsageError(f"{flag} must be >= 0, got {seconds:g}")
    if args.chunked_prefill_size < 0:
        raise UsageError("--chunked-prefill-size must be >= 0 (0 disables chunking), got "
                         f"{args.chunked_prefill_size}")
    if args.schedule_policy == "lpm" and args.disable_radix_cache:
        raise UsageError("--schedule-policy lpm orders prompts by their cached prefix: it needs "
                         "the prefix cache that --disable-radix-cache turns off; drop one")
    if args.mooncake_protocol == "rdma" and args.backend == "mooncake":
        check_rdma(args.mooncake_device)
    if args.mooncake_host.strip("[]") in ("0.0.0.0", "::", ""):
        raise UsageError(f"--mooncake-host {args.mooncake_host!r} is not an address a peer can "
                         "connect to: give this machine's address on the network (a pod's IP), "
                         "or 127.0.0.1 with both workers on one host")
    if ":" in args.mooncake_host:
        raise UsageError(f"--mooncake-host {args.mooncake_host}: the control sockets and the "
                         "transfer engine take IPv4 addresses only")
    role: Role
    if args.backend == "local":
        if args.role is not None:
            raise UsageError("--backend local runs prefill and decode in one process: drop --role")
        role = "both"
    elif args.role is None:
        raise UsageError(f"--backend {args.backend} needs --role prefill or --role decode")
    else:
        role = args.role
    if role != "decode" and args.allow_prefill:
        raise UsageError("--allow-prefill names the prefill servers a decode worker may send "
                         "its peer token to; this is not a decode worker: drop it")
    if role == "decode":
        given = [flag for flag, on in (("--overlap", args.overlap),
                                       ("--disable-radix-cache", args.disable_radix_cache),
                                       ("--schedule-policy", args.schedule_policy != "fcfs"))
                 if on]
        if given:
            raise UsageError(f"{' and '.join(given)}: the prefill role's; a decode server has "
                             "no prefill loop, prefix cache or waiting queue of prompts: drop it")
    if args.enable_trace:
        _check_trace_extra()
        from scheduler.service.tracing import otlp_endpoint_url

        try:
            otlp_endpoint_url(args.otlp_traces_endpoint or DEFAULT_OTLP_ENDPOINT)
        except ValueError as exc:
            raise UsageError(f"--otlp-traces-endpoint: {exc}") from None
    elif args.otlp_traces_endpoint is not None:
        raise UsageError("--otlp-traces-endpoint goes with --enable-trace")
    served = load_served(args) if args.model != "reference" else None
    pool_pages = args.pool_pages
    if args.kv_cache_memory is not None:
        sizing = served if served is not None else load_served(args)
        try:
            pool_pages = sizing.pages_for(args.kv_cache_memory, args.page_size)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    per_token = (served.kv_bytes_per_token if served is not None
                 else reference_kv_bytes_per_token(model_config(args)))
    pools = 2 if args.backend == "local" else 1
    _check_pool_fits(pool_pages * args.page_size * per_token, pools=pools)
    _check_slots_fit(args.metadata_slots, pools=pools)
    model_name = args.model_name
    if served is not None and model_name == REFERENCE_NAME:
        model_name = args.model
    try:
        return ServeConfig(
            role=role,
            model=model_config(args),
            scheduler=SchedulerConfig(
                chunked_prefill_size=args.chunked_prefill_size or None,
                radix_cache=not args.disable_radix_cache,
                **_as_given(args, _SCHEDULER_AS_GIVEN),
            ),
            pool_pages=pool_pages,
            api_key=api_key(args.api_key),
            bootstrap_host=args.host,
            bootstrap_port=args.bootstrap_port,
            mooncake=MooncakeConfig(
                hostname=args.mooncake_host, protocol=args.mooncake_protocol,
                device=args.mooncake_device, connect_timeout_s=args.connect_timeout,
                max_block_bytes=args.mooncake_block_mib << 20,
                engines=args.mooncake_engines,
                tcp_lanes=args.mooncake_tcp_lanes,
                retire_lost_after_s=args.retire_lost_prefill_after or None,
                lost_release_timeout_s=args.lost_prefill_release_timeout,
                bootstrap_timeout_s=args.bootstrap_timeout,
                token=peer_token(args.peer_token_file),
            ),
            model_name=model_name,
            served=served,
            tool_call_parser=args.tool_call_parser,
            allowed_prefills=_allowed_prefills(args.allow_prefill),
            otlp_traces_endpoint=(args.otlp_traces_endpoint or DEFAULT_OTLP_ENDPOINT)
            if args.enable_trace else None,
            prefill_delayer=(DelayerConfig() if args.prefill_delayer_max_delay_passes is None
                             else DelayerConfig(
                                 max_delay_passes=args.prefill_delayer_max_delay_passes))
            if args.enable_prefill_delayer else None,
            log=LogSettings(args.log_level, args.log_format),
            **_as_given(args, _SERVE_AS_GIVEN),
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(_config_as_flags(str(exc))) from exc


#: The configuration fields a refusal may name, by the flag that sets each.
_FIELD_FLAGS = {
    **{name: f"--{name.replace('_', '-')}" for name in (
        *_SCHEDULER_AS_GIVEN, *_SERVE_AS_GIVEN, "pool_pages", "chunked_prefill_size")
       if name not in ("backend", "device", "overlap")},  # words of other sentences too
    "connect_timeout_s": "--connect-timeout", "bootstrap_timeout_s": "--bootstrap-timeout",
    "max_block_bytes": "--mooncake-block-mib", "allowed_prefills": "--allow-prefill",
    "retire_lost_after_s": "--retire-lost-prefill-after",
    "lost_release_timeout_s": "--lost-prefill-release-timeout",
}
_CONFIG_FIELD = re.compile(r"(?:\b\w+Config\.|')?\b(" + "|".join(_FIELD_FLAGS) + r")\b'?")


def _config_as_flags(message: str) -> str:
    """A configuration's refusal with the fields it names written as the flags that set them
    (the library names its fields; a command-line user sets flags)."""
    return _CONFIG_FIELD.sub(lambda m: _FIELD_FLAGS[m.group(1)], message)


#: Where Linux lists the machine's RDMA devices.
RDMA_DEVICES = "/sys/class/infiniband"


def check_rdma(device: str, listing: str = RDMA_DEVICES) -> None:
    """:class:`UsageError` where rdma cannot work: the machine lists no RDMA device, or not
    the one ``--mooncake-device`` names (the transfer engine would only warn, and every
    transfer fail later)."""
    try:
        present = set(os.listdir(listing))
    except OSError:
        present = set()
    if not present:
        raise UsageError(f"--mooncake-protocol rdma: this machine has no RDMA device ({listing} "
                         "lists none); use --mooncake-protocol tcp, or give the container the "
                         "devices")
    missing = [d for d in (n.strip() for n in device.split(",")) if d and d not in present]
    if missing:
        raise UsageError(f"--mooncake-device {device}: no RDMA device {', '.join(missing)} here; "
                         f"{listing} lists {', '.join(sorted(present))}")


def _allowed_prefills(given: list[str]) -> tuple[str, ...]:
    """``--allow-prefill``'s addresses. An empty one (an unset shell variable) is refused: no
    address at all would mean any, the opposite of what the flag is for."""
    addresses = tuple(a.strip() for value in given for a in value.split(","))
    if "" in addresses:
        raise UsageError(f"--allow-prefill {','.join(given)!r}: an empty address; give "
                         "HOST:PORT, or leave the flag out to allow any prefill")
    return addresses


def _check_trace_extra() -> None:
    import importlib

    try:
        for module in ("opentelemetry.sdk.trace",
                       "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
            importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"--enable-trace needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({exc}); "
            "install them with: pip install 'pdlife[trace]'") from None


def _check_temp_dir() -> None:
    """:class:`UsageError` without a writable temporary directory, which the transfer engine's
    log and the rank processes' rendezvous go through (a read-only root file system)."""
    try:
        tempfile.gettempdir()
    except FileNotFoundError as exc:
        raise UsageError(f"{exc}: pdlife serve writes a few small files there (the transfer "
                         "engine's log, the rank processes' rendezvous); mount a writable "
                         "directory at /tmp or set TMPDIR") from None


def _check_port_free(host: str, port: int, flag: str) -> None:
    """:class:`UsageError` naming ``flag`` when ``host:port`` cannot be bound now (in use, or
    not an address of this machine): a clear refusal before anything is built."""
    if port == 0:
        return  # the system picks one
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            probe.bind(address)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address ({exc.strerror or exc})") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host}: not an address of this machine "
                             f"({exc.strerror}); bind one of its own, or 0.0.0.0") from None
        raise UsageError(f"{flag} {port}: cannot listen on {host}:{port} "
                         f"({exc.strerror or exc}); pick another port") from None


def one_arena_applies(args: argparse.Namespace) -> bool:
    """Whether ``pdlife serve`` keeps the process to one malloc arena
    (:mod:`scheduler.malloc_arena`): with ``--overlap``, on a ``--device`` that resolves to the
    CPU (``cpu``, ``cpu:N``, or ``auto`` where torch finds no CUDA device). A device torch
    refuses is not one: :func:`serve_config` says why."""
    if not args.overlap:
        return False
    from scheduler.model.decoder import resolve_device

    try:
        return resolve_device(args.device).type == "cpu"
    except ValueError:
        return False


def _serve(args: argparse.Namespace) -> int:
    # Before another thread allocates; importing torch to resolve the device starts a thread,
    # but none that allocates from an arena of its own (tests/test_malloc_arena.py).
    if one_arena_applies(args):
        from scheduler.malloc_arena import use_one_arena

        use_one_arena()
    import uvicorn

    from scheduler.service.app import create_app
    from scheduler.service.core import Service

    logs.configure(LogSettings(args.log_level, args.log_format))
    raise_open_files_limit()  # before the rank processes start: they inherit it
    # The ports before the model loads (seconds for a checkpoint): a clash is said at once.
    prefill_bootstrap = args.role == "prefill" and args.backend == "mooncake"
    if prefill_bootstrap and ":" in args.host:
        raise UsageError(f"--host {args.host}: the bootstrap endpoint listens on IPv4 only; "
                         "give an IPv4 address (0.0.0.0 for every interface)")
    _check_port_free(args.host, args.port, "--port")
    _check_temp_dir()
    if prefill_bootstrap:
        if args.bootstrap_port == args.port:
            raise UsageError(f"--bootstrap-port {args.port} is --port too: give the bootstrap "
                             "endpoint a port of its own")
        _check_port_free(args.host, args.bootstrap_port, "--bootstrap-port")
    if args.backend == "mooncake":
        from kv.mooncake_engine import port_range_problem

        if problem := port_range_problem():
            raise UsageError(problem)
    config = serve_config(args)
    ranks: Ranks | None = None  # a prefill's other ranks and DP replicas
    decode_ranks: DecodeRanks | None = None  # a decode's other TP ranks
    if config.dp_size * config.tp_size * config.pp_size > 1:
        # This process is rank 0, behind the HTTP front.
        if config.role == "decode":
            from scheduler.service.decode_ranks import DecodeRanks

            decode_ranks = DecodeRanks(config)
        else:
            from scheduler.service.ranks import Ranks

            ranks = Ranks(config)
    launched = ranks or decode_ranks
    try:
        service = Service(config, mesh=None if ranks is None else ranks.control,
                          replicas=ranks if ranks is not None and ranks.dp_size > 1 else None,
                          decode_mesh=None if decode_ranks is None else decode_ranks.control)
    except BaseException:
        if launched is not None:
            launched.close()
        raise
    if config.served is not None:  # built (rank 0's shard too): nothing more is built from it
        from scheduler.malloc_arena import give_back_freed

        if service.model is not config.served.model:  # rank 0 serves with its part only
            config.served.release_weights()
        config.served.release_checkpoint()
        give_back_freed()
    if launched is not None:
        launched.started()  # rank 0's engines are up: the other ranks build (and register)
        launched.watch(service.loop.fail)  # a rank that dies makes the server unhealthy
    if ranks is not None and service.prefill is not None:
        # The other replicas' metrics on its registry, and the delayer where it is on.
        ranks.delay(service.prefill)

    class DrainingServer(uvicorn.Server):
        """uvicorn, with a drain before the exit on the first SIGTERM/SIGINT; a second
        aborts what is live (answered 503) and exits, a third exits at once."""

        drain_started = False
        stopping = False
        aborted = 0  # by the drain's timeout and by a second signal, both counted
        aborted_lock = threading.Lock()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.stopping:
                self.should_exit = self.force_exit = True
                return
            if self.drain_started:
                self.stopping = True
                threading.Thread(target=self._stop, name="pdlife-stop", daemon=True).start()
                return
            self.drain_started = True
            service.begin_drain()
            threading.Thread(target=self._drain, name="pdlife-drain", daemon=True).start()

        linger_cut = threading.Event()  # a second signal ends the linger

        def _stop(self) -> None:
            self.linger_cut.set()
            logger.warning("second signal: aborting %d requests", service.live_requests())
            aborted = service.abort_all(
                "aborted: the server is shutting down (a second signal ended its drain)")
            with self.aborted_lock:
                self.aborted += aborted
            service.wait_drained(10.0)
            self.should_exit = True

        def _drain(self) -> None:
            drained = service.wait_drained(args.drain_timeout)
            if not drained:
                logger.warning("drain timeout (%g s): aborting %d requests",
                               args.drain_timeout, service.live_requests())
                aborted = service.abort_all(
                    f"aborted: the server is shutting down (its drain timeout of "
                    f"{args.drain_timeout:g} s ran out first)")
                with self.aborted_lock:
                    self.aborted += aborted
                service.wait_drained(10.0)
            if self.stopping or not service.healthy:
                logger.info("shutting down")  # aborted by a second signal, or failed
                self.should_exit = True
                return
            if args.drain_linger > 0:  # after a timed-out drain too: the router has to notice
                logger.info("%s; refusing new requests for %g s before shutting down "
                            "(--drain-linger)", "drained" if drained else "aborted the rest",
                            args.drain_linger)
                self.linger_cut.wait(args.drain_linger)
            logger.info("%s; shutting down", "drained" if drained else "drain timed out")
            self.should_exit = True

    server = DrainingServer(uvicorn.Config(
        create_app(service), host=args.host, port=args.port, log_config=None,
        access_log=args.log_level == "debug", lifespan="off", timeout_graceful_shutdown=30,
    ))
    service.start_loop()
    if (config.role == "decode" and config.backend == "mooncake"
            and config.mooncake.token is not None and not config.allowed_prefills):
        logger.warning("the peer token goes to whatever prefill bootstrap address a request "
                       "names: a client that can reach this worker can have it sent to a "
                       "server of its own; name the prefill servers with --allow-prefill "
                       "(docs/security.md)")
    logger.info("pdlife serve: role %s, backend %s, starting on http://%s:%d", config.role,
                config.backend, args.host, args.port)
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
        # uvicorn could not listen (the port taken since it was checked); it logged why.
    finally:
        try:
            # Rank 0's engines stop, then the other ranks (their KV writes stopped, each says
            # so), then rank 0 tells decode peers that the server's writes stopped where every
            # rank confirmed it, and only then its bootstrap endpoint closes.
            service.close(others=None if ranks is None else ranks.stop_writes)
        finally:
            if launched is not None:
                launched.close()
    if not server.started:
        logger.error("exiting %d: the HTTP server did not start", EXIT_USAGE)
        code = EXIT_USAGE
    elif service.loop.failure is not None:
        logger.error("exiting %d: the engine loop failed: %s", EXIT_ENGINE_FAILED,
                     service.loop.failure)
        code = EXIT_ENGINE_FAILED
    elif server.aborted:
        logger.warning("exiting %d: the drain aborted %d requests", EXIT_DRAIN_ABORTED,
                       server.aborted)
        code = EXIT_DRAIN_ABORTED
    else:
        code = 0
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End the process now: everything that holds a thread, a socket or a port is closed, and
    the interpreter's teardown (torch's, the transfer engine's) would only delay the exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


SERVE = Subcommand(
    name="serve",
    summary="run an SGLang-compatible prefill or decode worker over HTTP",
    description=(
        "Serve SGLang's worker API (/generate, /health, /server_info, /abort_request, "
        "/metrics, ...) as a prefill or decode server that SGLang's router can drive, with "
        "KV transfer over Mooncake. --backend local runs prefill and decode in this one "
        "process, and /generate answers whole requests. Requests for bootstrap host 2.2.2.2 "
        "use the fake backend (warm-up and health). SIGTERM drains, then exits 0 (3 if the "
        "drain had to abort requests at --drain-timeout, 1 if the engine loop failed)."
    ),
    epilog=(
        "/generate takes SGLang's sampling fields (temperature, top_p, top_k, min_p, "
        "sampling_seed, penalties, min_new_tokens, logit_bias, n, stop strings and regexes, "
        "json_schema/regex/ebnf) and logprob fields; one pdlife cannot honour (structural_tag, "
        "lora_path, image_data, ...) is refused with 400 naming it (docs/operations.md lists "
        "them all). The OpenAI API: /v1/completions, "
        "/v1/chat/completions (chat needs a model with a chat template, e.g. --model smollm2) "
        "and /v1/models. --tp-size/--pp-size run a prefill on TP x PP rank processes (a real "
        "checkpoint on TP only), --dp-size that many replicas of it; --tp-size a decode on TP "
        "ranks. "
        "SGLang's router refuses text batches and per-prompt sampling_params lists before a "
        "worker sees them (input_ids batches go through), and does not forward /abort_request "
        "(docs/operations.md)."
    ),
    add_arguments=_serve_arguments,
    run=_serve,
)

