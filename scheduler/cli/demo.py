"""``pdlife demo``: the command's arguments; the run is imported when the command runs, so
building the ``pdlife`` parser does not import torch."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence

from scheduler.cli.command import Subcommand, UsageError
from scheduler.demo.options import MAX_PROMPT_RANGE, MIN_REQUESTS, DemoOptions


def _arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    parser.add_argument("--requests", type=int, default=d.requests, metavar="N",
                        help=f"requests in the workload, at least {MIN_REQUESTS}, including the "
                        f"injected failures and aborts (default: {d.requests})")
    parser.add_argument("--backend", choices=("local", "mooncake"), default=d.backend,
                        help="KV transfer between the two sides: in-process page copies, or the "
                        "Mooncake Transfer Engine over loopback TCP (default: local)")
    parser.add_argument("--loop", choices=("normal", "overlap"), default=d.loop,
                        help="prefill scheduler loop; both give the same outputs "
                        "(default: normal)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="workload and fault-injection seed (default: 0)")
    parser.add_argument("--max-prompt", type=int, default=d.max_prompt, metavar="TOKENS",
                        help=f"longest prompt, in byte tokens ({MAX_PROMPT_RANGE[0]}.."
                        f"{MAX_PROMPT_RANGE[1]}); prompts range from 16 to this, and chunked "
                        f"prefill cuts the longest in four or more chunks; the reference model's "
                        f"workload only: with a real --model the prompts are chat questions "
                        f"(default: {d.max_prompt})")
    parser.add_argument("--model", default=d.model, metavar="MODEL",
                        help="reference (the exact fixed-point model, byte prompts), smollm2 "
                        "(SmolLM2-135M-Instruct answering chat questions), or a path to a GGUF "
                        "file or Hugging Face directory (default: reference)")
    parser.add_argument("--out", metavar="DIR", default=str(d.out),
                        help=f"where the diagrams, the trace and the summary go "
                        f"(default: {d.out})")


def _run(args: argparse.Namespace) -> int:
    try:
        options = DemoOptions(
            requests=args.requests, backend=args.backend, loop=args.loop, seed=args.seed,
            max_prompt=args.max_prompt, out=args.out, model=args.model,
        )
    except ValueError as exc:  # named as the option: "--requests must be ..."
        raise UsageError(re.sub(r"DemoOptions\.(\w+)",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(exc))) from None
    import torch

    from scheduler.demo.run import run_demo

    if "OMP_NUM_THREADS" not in os.environ:
        # The reference model is small: on two shared cores a second intra-op thread only
        # adds waiting (measured: the default run's serving phase 2 s with one, 42 s with two).
        torch.set_num_threads(1)
    from scheduler.model.checkpoint import CheckpointError
    from scheduler.model.shipped import ShippedModelMissing

    try:
        return run_demo(options).status
    except (CheckpointError, ShippedModelMissing) as exc:
        raise UsageError(str(exc)) from None


DEMO = Subcommand(
    name="demo",
    summary="run prefill and decode in one process on a synthetic workload, and check it",
    description=(
        "The embedded default under load: a prefill scheduler and its decode peer in one "
        "process serve a seeded workload with a few injected failures and mid-flight aborts, "
        "with a live progress display. Prints a summary (requests by outcome, TTFT phases "
        "p50/p99, prefill tokens/s, KV GB/s, PrefillDelayer outcomes), writes the lifecycle "
        "diagrams, a Perfetto trace of every request and a summary JSON to --out, and checks "
        "every output against the colocated reference model. Exits 1 if any output differs or "
        "a request did not end as planned."
    ),
    add_arguments=_arguments,
    run=_run,
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scheduler.cli demo``: the same command without the ``pdlife`` entry point."""
    parser = argparse.ArgumentParser(prog="pdlife demo", description=DEMO.description)
    DEMO.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return DEMO.run(args)
    except UsageError as exc:
        parser.exit(2, f"pdlife demo: {exc}\n")

