"""``pdlife serve --role prefill --dp-size 2 --enable-prefill-delayer``: the PrefillDelayer
negotiated across the DP replicas.

One server of two DP replicas (fake backend, one rank process beside rank 0) answers a batch
with the colocated model's first tokens while both replicas' schedulers gather each pass in
lockstep: every replica logs its delayer outcome counts when rank 0 stops the group, they are
equal (every pass decided the same on both), rank 0 saw no split on any pass, its /metrics
count the passes, and the server exits 0 on SIGTERM. The flag is refused where it does not
apply.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import httpx
import pytest

from scheduler.cli.command import UsageError
from scheduler.cli.serve import SERVE, serve_config
from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, model_flags

MODEL = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                    max_position=256, seed=9)
PROMPTS = [[(5 * i + 2 * j + 1) % 250 for j in range(3 + 7 * i)] for i in range(6)]
OUTCOMES = re.compile(r"prefill delayer outcomes of replica (\d): \[([\d, ]+)\]")


@pytest.mark.multiprocess
def test_two_replicas_negotiate_prefill_in_lockstep(tmp_path: Path) -> None:
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    *model_flags(MODEL), "--page-size", "4", "--chunked-prefill-size", "8",
                    "--dp-size", "2", "--enable-prefill-delayer", "--log-level", "info")
    try:
        server.wait_healthy(timeout=180)
        server.answers_as_colocated(MODEL, PROMPTS)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "pdlife_prefill_delayer_outcomes_total{" in metrics, metrics[-2000:]
        log = server.tail()
        assert server.stop(timeout=60) == 0, log
    finally:
        server.stop()
    log = server.log.read_text()
    counts = {int(m[1]): [int(v) for v in m[2].split(",")] for m in OUTCOMES.finditer(log)}
    assert sorted(counts) == [0, 1], log[-4000:]
    assert counts[0] == counts[1] and sum(counts[0]) > 0, counts
    assert "(0 splits)" in log and "decisions split" not in log, log[-4000:]
    assert "killing them" not in log and "a prefill rank failed" not in log, log[-4000:]


@pytest.mark.parametrize("flags", [
    ("--role", "prefill"),
    ("--role", "prefill", "--dp-size", "2", "--tp-size", "2"),
    ("--role", "decode", "--dp-size", "2"),
])
def test_the_delayer_flag_is_refused_where_it_does_not_apply(flags: tuple[str, ...]) -> None:
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    args = parser.parse_args([*flags, "--backend", "fake", *model_flags(MODEL),
                              "--enable-prefill-delayer"])
    with pytest.raises(UsageError, match="prefill delayer runs across the DP replicas"):
        serve_config(args)
