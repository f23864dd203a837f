"""The real model's forward: pdlife's Llama runner against Hugging Face transformers.

SmolLM2-135M-Instruct (the shipped GGUF file), or the checkpoint ``--model`` names (a GGUF file
or a Hugging Face directory), is loaded by both, in float32, in this process, with the same
thread count. The prompts are real text cut to lengths from 128 to 1,024 tokens.

- **Prefill.** pdlife computes all prompts as one packed batch through its paged runner (K/V
  written into the pool, the output head on each prompt's last position only); transformers runs
  its forward on each prompt in turn. Ratio: pdlife's prompt tokens/s ÷ transformers'.
- **Decode.** pdlife continues all those requests together, one batched decode step per token;
  transformers' ``generate`` continues one request at a time (its decode time is its time for
  ``1 + N`` new tokens minus its time for one, so its own prefill is not counted). Ratio:
  pdlife's generated tokens/s ÷ transformers'.
- ``max_logit_diff``: the largest difference between the two models' logits after each prompt.

Rounds alternate the two sides; a ratio is the median of its rounds. On a machine that other
work shares, ``--threads 1 --clock cpu`` compares the CPU time each side spends.

Last line: ``RESULT model prefill_ratio=<> decode_ratio=<> max_logit_diff=<>``.
"""

from __future__ import annotations

import argparse
import os

# transformers' GGUF loader draws a tqdm progress bar that its own switch does not reach; tqdm
# reads TQDM_* defaults when it is first imported (importing torch does).
os.environ.setdefault("TQDM_DISABLE", "1")

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kv.pages import pages_needed
from kv.pool import KVPool
from scheduler.model.select import ServedModel, load_model
from scheduler.model.shipped import shipped_path
from scheduler.runner import ForwardItem

TEXT = (
    "The history of astronomy is a long story of patient observation. Ancient farmers watched "
    "the rising of bright stars to know when to plant; sailors steered by the pole star; "
    "priests kept calendars of eclipses. With the telescope came moons around Jupiter, phases "
    "of Venus and the slow realisation that the Earth is one planet among many. Later, "
    "spectroscopy told astronomers what the stars are made of, photography let them measure "
    "faint galaxies, and radio dishes opened a new window on the sky. Today, space telescopes "
    "study the light of the first galaxies, while careful surveys map billions of stars. "
)


def prompts(model: ServedModel, lengths: list[int]) -> list[list[int]]:
    ids = model.encode(TEXT * (1 + max(lengths) // 100))
    return [ids[i : i + n] for i, n in enumerate(lengths)]


#: What the timings read: wall time (the default), or this process's CPU time (``--clock
#: cpu``: with one thread, a figure that other work on a shared machine hardly moves).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = clock()
    out = fn()
    return clock() - start, out


def pdlife_round(model: ServedModel, batch: list[list[int]], steps: int,
                 page_size: int = 16) -> tuple[float, float, torch.Tensor]:
    """Seconds of the batched prefill, seconds of ``steps`` batched decode steps, and the
    logits after each prompt."""
    real = model.model
    needs = [pages_needed(len(p) + steps, page_size) for p in batch]
    pool: KVPool = real.make_pool(num_pages=sum(needs), page_size=page_size)
    firsts = [sum(needs[:i]) for i in range(len(batch))]
    pages = [tuple(range(f, f + n)) for f, n in zip(firsts, needs, strict=True)]
    items = [ForwardItem(f"p{i}", tuple(p), 0, pages[i]) for i, p in enumerate(batch)]
    prefill_s, logits = timed(lambda: real.logits(pool, items))
    last = logits.argmax(-1).tolist()

    def decode() -> None:
        nonlocal last
        for t in range(steps):
            step = [ForwardItem(f"p{i}", (last[i],), len(p) + t, pages[i])
                    for i, p in enumerate(batch)]
            last = real.logits(pool, step).argmax(-1).tolist()

    decode_s, _ = timed(decode)
    return prefill_s, decode_s, logits


def hf_round(hf: Any, batch: list[list[int]], steps: int) -> tuple[float, float, torch.Tensor]:
    """transformers: seconds of its forward of each prompt in turn, seconds of decoding
    ``steps`` tokens per prompt with ``generate`` one request at a time, the last logits."""
    from transformers import GenerationConfig

    def greedy(n: int) -> Any:
        return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)

    last: list[torch.Tensor] = []
    prefill_s = decode_s = 0.0
    for ids in batch:
        x = torch.tensor([ids])
        seconds, out = timed(lambda x=x: hf(x))
        prefill_s += seconds
        last.append(out.logits[0, -1].float())
        one_s, _ = timed(lambda x=x: hf.generate(x, generation_config=greedy(1)))
        all_s, _ = timed(lambda x=x: hf.generate(x, generation_config=greedy(1 + steps)))
        decode_s += max(all_s - one_s, 1e-9)
    return prefill_s, decode_s, torch.stack(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts per batch (default: %(default)s)")
    parser.add_argument("--min-len", type=int, default=128,
                        help="shortest prompt; the others evenly up to --max-len "
                             "(default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=1024,
                        help="longest prompt (default: %(default)s)")
    parser.add_argument("--decode-steps", type=int, default=16,
                        help="tokens decoded per prompt after the prefill (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed rounds of both sides (default: %(default)s)")
    # One thread and CPU time by default, as the published figures: two sides sharing a small
    # machine's cores measure the scheduling of threads, not the model (docs/models.md).
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (default: %(default)s)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="wall time, or this process's CPU time (default: %(default)s)")
    parser.add_argument("--model", default="smollm2",
                        help="what both sides load: smollm2 (shipped), a .gguf file or a "
                        "Hugging Face directory (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = load_model(args.model)
    if model.is_reference:
        parser.error("--model: the reference model has no transformers twin; name a checkpoint")
    if args.max_len > model.max_position:
        parser.error(f"--max-len {args.max_len}: {model.name} holds {model.max_position} "
                     "positions")
    path = shipped_path("smollm2") if args.model == "smollm2" else Path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32) if path.is_dir() else AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    step = (args.max_len - args.min_len) / max(1, args.prompts - 1)
    lengths = [round(args.min_len + i * step) for i in range(args.prompts)]
    batch = prompts(model, lengths)
    tokens, generated = sum(lengths), args.decode_steps * len(batch)
    print(f"{model.name} fp32, {args.threads} threads, {args.clock} time: "
          f"{len(batch)} prompts of "
          f"{lengths[0]}..{lengths[-1]} tokens ({tokens} in all), {args.decode_steps} decode "
          f"steps each")
    prefill_ratios: list[float] = []
    decode_ratios: list[float] = []
    max_diff = 0.0
    with torch.inference_mode():
        for r in range(args.rounds):
            ours_p, ours_d, ours_logits = pdlife_round(model, batch, args.decode_steps)
            hf_p, hf_d, hf_logits = hf_round(hf, batch, args.decode_steps)
            max_diff = max(max_diff, (ours_logits - hf_logits).abs().max().item())
            prefill_ratios.append(hf_p / ours_p)
            decode_ratios.append(hf_d / ours_d)
            print(f"round {r}: prefill pdlife {tokens / ours_p:7.0f} tok/s, transformers "
                  f"{tokens / hf_p:7.0f} tok/s (x{hf_p / ours_p:.2f}); decode pdlife "
                  f"{generated / ours_d:6.1f} tok/s, transformers {generated / hf_d:6.1f} tok/s "
                  f"(x{hf_d / ours_d:.2f})")
    print(f"RESULT model prefill_ratio={statistics.median(prefill_ratios):.3f} "
          f"decode_ratio={statistics.median(decode_ratios):.3f} max_logit_diff={max_diff:.2e}")


if __name__ == "__main__":
    main()
