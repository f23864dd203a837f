"""Grammar masks over SmolLM2's 49,152-token vocabulary: pdlife's mask against llguidance's own.

An answer that a grammar matches is walked token by token, for each grammar kind: at every
step the constraint computes its mask, then accepts the answer's next token.

- **pdlife**: :meth:`LLGuidanceConstraint.allowed` (a bool tensor of the model's vocabulary,
  what the sampler applies) plus :meth:`~LLGuidanceConstraint.accept` (validate, then consume).
- **baseline**: llguidance's ``compute_bitmask`` plus ``consume_token`` on a bare matcher (the
  packed bitmask, what an inference engine's llguidance backend fills; the floor).

The grammars: a JSON schema, any JSON object, a regex, and an ``ebnf`` grammar (written in
Lark's syntax). Ratio: pdlife's microseconds per token ÷ the baseline's (median over rounds).
Also printed: building the compiler (once per model) and compiling each grammar (once per
request, on each side). Only the tokenizer is loaded, not the weights. Every figure is wall time
unless ``--clock cpu`` asks for this process's CPU time; the output says which.

Last line: ``RESULT grammar ratio=<> us_per_mask=<> us_per_mask_baseline=<> compile_ms=<>
clock=<wall|cpu>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import llguidance
import torch

from lifecycle import GrammarKind, GrammarSpec
from scheduler.model.hf_tokenizer import load_tokenizer
from scheduler.model.loader import load_checkpoint
from scheduler.model.shipped import shipped_path
from scheduler.sample.grammar import LLGuidanceCompiler, grammar_text, hf_compiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"],
          "address": {"city": "London"}}
CASES = [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)), json.dumps(ANSWER, indent=2)),
    (GrammarSpec(GrammarKind.JSON_OBJECT), json.dumps(ANSWER)),
    (GrammarSpec(GrammarKind.REGEX, r"\+?[0-9]{1,3}( [0-9]{2,4}){2,4}"), "+44 20 7946 0958"),
    (GrammarSpec(GrammarKind.EBNF, 'start: "The answer is " ("yes" | "no") "."'),
     "The answer is yes."),
]


CLOCK_NAMES = {"wall": "wall time", "cpu": "this process's CPU time"}


def pdlife_walk(compiler: LLGuidanceCompiler, spec: GrammarSpec, tokens: list[int]) -> None:
    constraint = compiler.compile(spec)
    for token in tokens:
        if not bool(constraint.allowed()[token]):
            raise SystemExit(f"{spec.kind}: token {token} masked out")
        constraint.accept(token)


def baseline_walk(compiler: LLGuidanceCompiler, grammar: str, tokens: list[int]) -> None:
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
    for token in tokens:
        matcher.compute_bitmask()
        if not matcher.consume_token(token):
            raise SystemExit(f"baseline: token {token} rejected: {matcher.get_error()}")


def seconds(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20,
                        help="timed compiles and mask walks of each side (default: %(default)s)")
    parser.add_argument("--clock", choices=sorted(CLOCK_NAMES), default="wall",
                        help="what every figure is timed in: wall time, or this process's CPU "
                             "time, which other work on a shared machine moves less (default: "
                             "%(default)s)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(1)
    print(f"timed in {CLOCK_NAMES[args.clock]} (--clock {args.clock}), medians of {args.rounds} "
          "rounds")

    tokenizer = load_tokenizer(load_checkpoint(shipped_path("smollm2")).tokenizer)
    start = clock()
    compiler = hf_compiler(tokenizer.tokenizer, eos_token_ids=tokenizer.eos_token_ids,
                           vocab_size=tokenizer.vocab_size)
    build_s = clock() - start
    print(f"compiler for {tokenizer.vocab_size} tokens: {build_s * 1e3:.0f} ms")

    ratios, per_mask, per_mask_base, compile_ms = [], [], [], []
    for spec, text in CASES:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        grammar = grammar_text(spec)
        compile_s = statistics.median(
            seconds(partial(compiler.compile, spec), clock) for _ in range(args.rounds))
        ours, base = [], []
        for _ in range(args.rounds):  # alternate the two sides; both walks compile first
            ours.append(seconds(partial(pdlife_walk, compiler, spec, tokens), clock) - compile_s)
            base.append(seconds(partial(baseline_walk, compiler, grammar, tokens),
                                clock)
                        - compile_s)
        us, us_base = (statistics.median(x) / len(tokens) * 1e6 for x in (ours, base))
        ratios.append(us / us_base)
        per_mask.append(us)
        per_mask_base.append(us_base)
        compile_ms.append(compile_s * 1e3)
        print(f"{spec.kind.value:12} {len(tokens):3} tokens: pdlife {us:6.1f} us/token, "
              f"llguidance bitmask {us_base:6.1f} us/token, compile {compile_s * 1e3:.2f} ms")
    print(f"RESULT grammar ratio={statistics.median(ratios):.2f} "
          f"us_per_mask={statistics.median(per_mask):.1f} "
          f"us_per_mask_baseline={statistics.median(per_mask_base):.1f} "
          f"compile_ms={statistics.median(compile_ms):.2f} clock={args.clock}")


if __name__ == "__main__":
    main()
