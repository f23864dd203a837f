"""``pdlife generate``: the colocated reference run, to check a served answer.

It builds the model from the same flags as ``pdlife serve`` (:mod:`scheduler.cli.model_flags`),
so the two agree token for token when started alike.
"""

from __future__ import annotations

import argparse
import json
import sys

from scheduler.cli.command import Subcommand, UsageError
from scheduler.cli.model_flags import add_model_arguments, load_served


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (the model's tokenizer, as /generate's "
                        "text)")
    prompt.add_argument("--input-ids", help="prompt token ids, comma-separated")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as one user message through the model's chat "
                        "template")
    parser.add_argument("--system", metavar="TEXT",
                        help="with --chat, a system message before the user's (as a chat "
                        "request's first message with role system)")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="tokens to generate at most; the answer ends earlier on a stop "
                        "token or EOS (default: 16)")
    parser.add_argument("--stop-token-ids", default="", help="comma-separated stop token ids")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_model_arguments(parser)


def _ids(text: str, flag: str) -> list[int]:
    if not text.strip():
        return []
    try:
        return [int(t) for t in text.split(",")]  # an empty entry ("1,,2") is a typo
    except ValueError:
        raise UsageError(f"{flag} wants comma-separated integers, got {text!r}") from None


def _generate(args: argparse.Namespace) -> int:
    from scheduler.model.reference import ModelInputError
    from scheduler.runner import outside_vocabulary

    if args.chat and args.prompt is None:
        raise UsageError("--chat needs --prompt")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat")
    served = load_served(args)
    if args.chat and (served.is_reference or served.tokenizer.chat_template is None):
        raise UsageError(f"--chat needs a model with a chat template; {served.name} has none "
                         "(send the prompt as it is, without --chat)")
    try:
        if args.system is not None:
            ids = served.encode_messages([{"role": "system", "content": args.system},
                                          {"role": "user", "content": args.prompt}])
        elif args.prompt is not None:
            ids = served.encode(args.prompt, chat=args.chat)
        else:
            ids = _ids(args.input_ids, "--input-ids")
    except ValueError as exc:  # the chat template refused the messages
        raise UsageError(str(exc)) from exc
    stops = _ids(args.stop_token_ids, "--stop-token-ids")
    outside = outside_vocabulary(stops, served.vocab_size)
    if outside:
        raise UsageError(f"--stop-token-ids: {outside}")
    try:
        out = served.generate(ids, args.max_new_tokens, stop_token_ids=stops,
                              ignore_eos=args.ignore_eos)
    except ModelInputError as exc:  # one prompt: no request id to name
        raise UsageError(exc.problem.replace("max_new_tokens", "--max-new-tokens")) from exc
    json.dump({"text": served.decode(out), "output_ids": out, "prompt_tokens": len(ids)},
              sys.stdout)
    sys.stdout.write("\n")
    return 0


GENERATE = Subcommand(
    name="generate",
    summary="run the colocated model and print its answer as JSON",
    description=(
        "Greedy generation with the colocated model (--model: the reference model, smollm2 "
        "or a checkpoint path; the whole prompt in one forward, then one token at a time, no "
        "transfer), from the same model flags and defaults as pdlife serve, so a served answer "
        "can be checked: prints {text, output_ids, prompt_tokens}."
    ),
    add_arguments=_generate_arguments,
    run=_generate,
)
