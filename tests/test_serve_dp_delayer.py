"""``pdlife serve --role prefill --dp-size 2 --enable-prefill-delayer``: the PrefillDelayer
negotiated across the DP replicas.

One server of two DP replicas (fake backend; replicas of one rank, of TP 2 and of PP 2, whose
second ranks decide from their first rank's rows) answers a batch with the colocated model's first
tokens while both replicas' schedulers gather each pass in lockstep: every rank logs its
delayer outcome counts when it stops, they are all equal (every pass decided the same on
every rank), rank 0 saw no split on any pass, its /metrics count each replica's passes (equal
decisions, labelled ``dp_rank``), and the server exits 0 on SIGTERM. The flag is refused where
it does not apply.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from scheduler.cli.command import UsageError
from scheduler.cli.serve import SERVE, serve_config
from scheduler.model.reference import ModelConfig
from tests.service_harness import Server, model_flags, wait_for
from tests.test_dp_metrics import scraped

MODEL = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                    max_position=256, seed=9)
PROMPTS = [[(5 * i + 2 * j + 1) % 250 for j in range(3 + 7 * i)] for i in range(6)]
# Each replica (and rank) logs its counts by name: "none=3 no_wait=0 ... delay=5".
OUTCOMES = re.compile(r"prefill delayer outcomes of replica (\d( rank \d)?): "
                      r"((?:[a-z_]+=\d+ ?){6})")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [(), ("--tp-size", "2"), ("--pp-size", "2")],
                         ids=["one-rank", "tp2", "pp2"])
def test_two_replicas_negotiate_prefill_in_lockstep(tmp_path: Path,
                                                    layout: tuple[str, ...]) -> None:
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    *model_flags(MODEL), "--page-size", "4", "--chunked-prefill-size", "8",
                    "--dp-size", "2", *layout, "--enable-prefill-delayer",
                    "--log-level", "info")
    try:
        server.wait_healthy(timeout=180)
        server.answers_as_colocated(MODEL, PROMPTS)

        def decisions() -> dict[str, Counter[tuple[str, str, str]]]:
            """Each replica's delayer decisions (whether it ran a batch left out)."""
            families = scraped(httpx.get(f"{server.url}/metrics", timeout=60).text)
            out: dict[str, Counter[tuple[str, str, str]]] = {}
            for name, labels, value in families["pdlife_prefill_delayer_outcomes"]:
                if name.endswith("_total"):
                    out.setdefault(labels["dp_rank"], Counter())[
                        labels["input_estimation"], labels["output_allow"],
                        labels["output_reason"]] += int(value)
            return out

        def equal(seen: dict[str, Counter[tuple[str, str, str]]]) -> bool:
            return sorted(seen) == ["0", "1"] and seen["0"] == seen["1"] and seen["0"].total() > 0

        # A replica records a pass's decision at its end, a moment after rank 0's.
        wait_for(lambda: equal(decisions()), 60, "both replicas' delayer decisions, equal")
        log = server.tail()
        assert server.stop(timeout=60) == 0, log
    finally:
        server.stop()
    log = server.log.read_text()
    # Every rank of every replica: the first ranks, and with TP 2 the second ones.
    counts = {m[1]: [int(v.split("=")[1]) for v in m[3].split()]
              for m in OUTCOMES.finditer(log)}
    ranks = ["0", "1"] if not layout else ["0", "0 rank 1", "1", "1 rank 1"]
    assert sorted(counts) == ranks, log[-4000:]
    assert all(c == counts["0"] for c in counts.values()) and sum(counts["0"]) > 0, counts
    assert "(0 splits)" in log and "decisions split" not in log, log[-4000:]
    assert "killing them" not in log and "a prefill rank failed" not in log, log[-4000:]


@pytest.mark.parametrize("flags", [
    ("--role", "prefill"),
    ("--role", "decode", "--dp-size", "2"),
])
def test_the_delayer_flag_is_refused_where_it_does_not_apply(flags: tuple[str, ...]) -> None:
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    args = parser.parse_args([*flags, "--backend", "fake", *model_flags(MODEL),
                              "--enable-prefill-delayer"])
    with pytest.raises(UsageError, match="prefill delayer runs across the DP replicas"):
        serve_config(args)


def test_the_delayers_passes_go_with_the_delayer() -> None:
    """Given alone, the flag was taken and did nothing."""
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    base = ["--role", "prefill", "--backend", "fake", "--dp-size", "2", *model_flags(MODEL)]
    with pytest.raises(UsageError, match=r"^--prefill-delayer-max-delay-passes goes with "
                                         r"--enable-prefill-delayer$"):
        serve_config(parser.parse_args([*base, "--prefill-delayer-max-delay-passes", "5"]))
    both = ["--enable-prefill-delayer", "--prefill-delayer-max-delay-passes", "5"]
    config = serve_config(parser.parse_args([*base, *both]))
    assert config.prefill_delayer is not None and config.prefill_delayer.max_delay_passes == 5
    config = serve_config(parser.parse_args([*base, "--enable-prefill-delayer"]))
    assert config.prefill_delayer is not None and config.prefill_delayer.max_delay_passes == 30
