"""SGLang's router (0.3.2) in front of a pdlife prefill and a pdlife decode worker serving
``--model smollm2``, KV over Mooncake, all as processes on loopback: ``/generate`` answers with
the tokens ``pdlife generate --model smollm2`` prints (the colocated run), for text and chat
prompts, a prompt that the prefill side cuts into chunks, and requests sent together."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.test_router_e2e import Cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.mooncake]

SMOLLM2 = ["--model", "smollm2", "--pool-pages", "256"]
MAX_NEW = 24
TEXT = "The three primary colours are"
QUESTION = "What is the capital of France?"
# Longer than the cluster's --chunked-prefill-size (64): the prefill computes it in chunks.
LONG = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
        "The story should have a beginning, a middle and an end, and it should mention the "
        "sea, the wind, an old dog and a letter from a stranger who lives far away.")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Two processes load SmolLM2 at once on shared cores: give them time.
    with Cluster(tmp_path_factory.mktemp("smollm2-router"), SMOLLM2,
                 startup_timeout=240) as started:
        yield started


def routed(cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def pdlife_generate(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    from scheduler.cli.main import main

    capsys.readouterr()
    assert main(["generate", "--model", "smollm2", "--max-new-tokens", str(MAX_NEW),
                 *flags]) == 0
    answer: dict[str, Any] = json.loads(capsys.readouterr().out)
    return answer


def test_generate_through_the_router_equals_pdlife_generate(
        cluster: Cluster, smollm2: Any, capsys: pytest.CaptureFixture[str]) -> None:
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    text = routed(cluster, {"text": TEXT, "sampling_params": greedy})
    want = pdlife_generate(capsys, "--prompt", TEXT)
    assert want["output_ids"] and text["output_ids"] == want["output_ids"]
    assert text["text"] == want["text"]

    # The chat template is the CLI's (--chat); /generate takes the templated ids.
    chat = routed(cluster, {"input_ids": smollm2.encode(QUESTION, chat=True),
                            "sampling_params": greedy})
    want = pdlife_generate(capsys, "--chat", "--prompt", QUESTION)
    assert chat["output_ids"] == want["output_ids"]
    assert want["text"] == "The capital of France is Paris."


def test_prompts_sent_together_equal_the_colocated_run(cluster: Cluster, smollm2: Any) -> None:
    prompts = [smollm2.encode(QUESTION, chat=True), smollm2.encode(LONG, chat=True),
               smollm2.encode(TEXT), smollm2.encode("Name three fruits:", chat=True)]
    assert len(prompts[1]) > 64
    want = [smollm2.generate(p, MAX_NEW) for p in prompts]

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            answers = await asyncio.gather(*(client.post(f"{cluster.url}/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            }) for p in prompts))
        for r in answers:
            assert r.status_code == 200, r.text
        return [r.json()["output_ids"] for r in answers]

    assert asyncio.run(main()) == want
