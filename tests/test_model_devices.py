"""Devices: a model and the pools it makes are on one device however the device was named, and
a device this torch cannot compute on is refused before anything is built.

A CUDA model named ``cuda`` makes pools whose tensors report ``cuda:0``; ``cpu:0`` against
``cpu`` is the same naming difference on a machine without a GPU.
"""

from __future__ import annotations

from scheduler.model.select import load_model
from scheduler.runner import ForwardBatch, ForwardItem
from tests.test_checkpoint import IDS
from tests.test_own_checkpoint import tiny_directory


def test_a_model_on_a_device_named_with_an_index_runs_over_the_pools_it_makes(tmp_path):
    directory = tiny_directory(tmp_path / "tiny")
    tokens = {}
    for device in ("cpu", "cpu:0"):
        served = load_model(str(directory), device=device)
        pool = served.make_pool(num_pages=4, page_size=16)
        assert (str(served.model.device), str(pool.device)) == (device, "cpu")
        runner = served.runner(served.model, pool)
        tokens[device] = runner.forward(ForwardBatch((ForwardItem("t", tuple(IDS), 0,
                                                                  (0, 1, 2, 3)),)))
    assert tokens["cpu:0"] == tokens["cpu"]
