"""Shared test configuration: Hypothesis profiles, torch threads, the real model (loaded once).

``ci`` (the default, and what CI runs) is bounded so the suite fits the CI budget; ``dev`` is
larger for local fuzzing: ``HYPOTHESIS_PROFILE=dev pytest``.
"""

from __future__ import annotations

import os

# transformers' GGUF loader draws a tqdm progress bar that transformers' own switch
# (``disable_progress_bar``) does not reach; tqdm reads TQDM_* defaults when it is first
# imported, which importing torch does.
os.environ.setdefault("TQDM_DISABLE", "1")

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

# The test models are small: on shared CI cores, intra-op threads only add waiting (and they
# compete with the transfer workers). Processes the tests spawn set their own.
torch.set_num_threads(1)



def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--transfer-harness", action="append", default=[], metavar="MODULE:NAME",
        help="also run the transfer contract suite (tests/test_transfer_contract.py) over this "
             "backend harness, or list of harnesses (see tests/transfer_harness.py)")


settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# -- the real model, loaded once per test session ------------------------------------------------

@pytest.fixture(scope="session")
def smollm2() -> Any:
    """SmolLM2-135M-Instruct on pdlife's Llama runner (float32), with its tokenizer."""
    from scheduler.model.select import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_bf16() -> Any:
    """SmolLM2-135M-Instruct on pdlife's Llama runner in bfloat16 (weights, matmuls, KV)."""
    from scheduler.model.select import load_model

    return load_model("smollm2", dtype="bfloat16")


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """The same GGUF file loaded by Hugging Face transformers (float32): the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from scheduler.model.shipped import shipped_path

    hf_logging.disable_progress_bar()
    path = shipped_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer
