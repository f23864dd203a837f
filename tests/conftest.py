"""Shared test configuration: Hypothesis profiles, torch threads.

``ci`` (the default, and what CI runs) is bounded so the suite fits the CI budget; ``dev`` is
larger for local fuzzing: ``HYPOTHESIS_PROFILE=dev pytest``.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# The test models are small: on shared CI cores, intra-op threads only add waiting (and they
# compete with the transfer workers). Processes the tests spawn set their own.
torch.set_num_threads(1)

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
