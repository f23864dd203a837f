"""Prefill and decode in one process, checked against the reference.

:class:`scheduler.embedded.EmbeddedPair` wires a prefill scheduler and its decode peer around
the reference model (a small seeded Llama-style decoder) and a byte-level tokenizer; the local
backend really copies each request's KV pages from the prefill pool into the decode pool, and
``--backend mooncake`` sends them through two Mooncake Transfer Engines over loopback TCP, with
the engines' own settings (a 1 MiB cut and a peer token, both sides alike). This script
generates a few continuations and checks each against the colocated reference run, token for
token. (The weights are seeded, not trained: the tokens are arbitrary, and equal.)

    python examples/embed_pair.py [--backend mooncake]

docs/embedding.md walks through it. Exit status 1 if an output differs from the reference.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from kv.mooncake_engine import MooncakeConfig
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import ReferenceModel
from scheduler.prefill import SchedulerConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("local", "mooncake"), default="local")
    args = ap.parse_args()
    tok = ByteTokenizer()
    scheduler = SchedulerConfig(chunked_prefill_size=64)
    if args.backend == "mooncake":
        engines = MooncakeConfig(max_block_bytes=1 << 20, token=secrets.token_hex(16))
        config = PairConfig(scheduler=scheduler, backend="mooncake", mooncake=engines)
    else:
        config = PairConfig(scheduler=scheduler)
    pair = EmbeddedPair(config)
    reference = ReferenceModel(pair.model)
    prompts = {
        "greeting": "Hello from the prefill side.",
        "pages": "Pages move from one pool to the other, " * 6,  # > 64 tokens: chunked
        "stop": "Stop at a byte the model writes",
    }
    # The weights are random, so no byte is sure to come: stop on the byte it writes sixth
    # (the answer stops where that byte first comes, which may be sooner).
    sixth = reference.generate(tok.encode(prompts["stop"], add_bos=True), 6)[5]
    sampling = {
        "greeting": SamplingParams(max_new_tokens=12),
        "pages": SamplingParams(max_new_tokens=8),
        "stop": SamplingParams(max_new_tokens=24, stop_token_ids=(sixth,)),
    }
    for rid, text in prompts.items():
        pair.submit(rid, tok.encode(text, add_bos=True), sampling[rid])
    try:
        outcomes = pair.run_until_done(prompts, timeout=120)
    finally:
        pair.close()

    differ = 0
    for rid, text in prompts.items():
        o = outcomes[rid]
        s = sampling[rid]
        want = reference.generate(tok.encode(text, add_bos=True), s.max_new_tokens,
                                  s.stop_token_ids)
        same = list(o.decode.output_ids) == want
        differ += not same
        print(f"{rid:9} prefill {o.prefill.state.name}, decode {o.decode.state.name} "
              f"({o.decode.finish_reason}, {len(o.decode.output_ids)} tokens), "
              f"{'matches' if same else 'DIFFERS FROM'} the reference: "
              f"{list(o.decode.output_ids)}")
    sent = pair.prefill.metrics.registry.get_sample_value("pdlife_transfer_bytes_total")
    print(f"KV and metadata handed to the {args.backend} transfer backend: {sent:.0f} bytes")
    print("ok" if not differ else f"{differ} outputs differ from the reference")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
