"""``pdlife serve``'s flags that set a configuration field default to that field's default, read
from the configuration class (:func:`scheduler.cli.serve.flag_defaults`): a server started
without them is configured as the library's defaults say, and a default changed in the class
changes the flag's with it."""

from __future__ import annotations

import argparse
from typing import Any

import attrs
import pytest

import kv.mooncake_engine
import scheduler.cli.serve
import scheduler.prefill.config
import scheduler.prefill.delayer_decision
import scheduler.service.config
from kv.mooncake_engine import MooncakeConfig
from scheduler.cli.main import build_parser
from scheduler.cli.serve import SERVE, flag_defaults, serve_config
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer_decision import DelayerConfig
from scheduler.service.config import ServeConfig
from scheduler.service.logs import LogSettings

#: The ServeConfig fields the flags set as they are given, by flag.
SERVE_FIELDS = {"--pool-pages": "pool_pages", "--metadata-slots": "metadata_slots",
                "--waiting-timeout": "waiting_timeout", "--max-body-bytes": "max_body_bytes",
                "--bootstrap-port": "bootstrap_port"}


def defaulted(*flags: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *flags])


def field_default(cls: type, name: str) -> Any:
    default = attrs.fields_dict(cls)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]


def test_a_server_started_without_the_flags_has_the_configuration_classes_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PDLIFE_PEER_TOKEN", raising=False)
    for role in ("prefill", "decode"):
        config = serve_config(defaulted("--role", role))
        assert config.mooncake == MooncakeConfig(), role
        # The one field serve sets otherwise: the prefix cache is on unless turned off.
        assert attrs.evolve(config.scheduler, radix_cache=False) == SchedulerConfig(), role
        for name in (*SERVE_FIELDS.values(), "log"):
            assert getattr(config, name) == field_default(ServeConfig, name), (role, name)
    delayed = serve_config(defaulted("--role", "prefill", "--backend", "fake", "--dp-size", "2",
                                     "--enable-prefill-delayer"))
    assert delayed.prefill_delayer == DelayerConfig()


def drifted(cls: type, **defaults: Any) -> type:
    """``cls`` with other defaults for the fields named."""
    return attrs.make_class(f"Drifted{cls.__name__}", {
        name: attrs.field(default=value) for name, value in defaults.items()}, bases=(cls,),
        frozen=True)


def test_a_default_changed_in_a_configuration_class_changes_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each class given other defaults (as a later change of the library would): the flags
    that set those fields default to the new values, in the flag's unit."""
    for module, cls, defaults in (
        (kv.mooncake_engine, MooncakeConfig, dict(
            engines=3, tcp_lanes=8, retire_lost_after_s=90.0, max_block_bytes=8 << 20,
            connect_timeout_s=45.0, lost_release_timeout_s=12.0, hostname="10.0.0.7",
            protocol="rdma", device="mlx5_0")),
        (scheduler.prefill.config, SchedulerConfig, dict(
            page_size=32, chunked_prefill_size=4096, max_prefill_tokens=8192,
            max_running_requests=128, bootstrap_timeout=120.0, transfer_timeout=90.0,
            schedule_policy="lpm")),
        (scheduler.service.config, ServeConfig, dict(
            pool_pages=1024, metadata_slots=96, waiting_timeout=150.0, max_body_bytes=4 << 20,
            bootstrap_port=9000, stream_interval=4)),
        (scheduler.prefill.delayer_decision, DelayerConfig, dict(max_delay_passes=12)),
        (scheduler.cli.serve, LogSettings, dict(level="warning", format="json")),
    ):
        monkeypatch.setattr(module, cls.__name__, drifted(cls, **defaults))
    args = vars(defaulted())
    assert {flag: args[flag[2:].replace("-", "_")] for flag in flag_defaults()
            if flag != "--prefill-delayer-max-delay-passes"} == {
        "--mooncake-engines": 3, "--mooncake-tcp-lanes": 8, "--retire-lost-prefill-after": 90.0,
        "--mooncake-block-mib": 8, "--connect-timeout": 45.0,
        "--lost-prefill-release-timeout": 12.0, "--mooncake-host": "10.0.0.7",
        "--mooncake-protocol": "rdma", "--mooncake-device": "mlx5_0",
        "--page-size": 32, "--chunked-prefill-size": 4096, "--max-prefill-tokens": 8192,
        "--max-running-requests": 128, "--bootstrap-timeout": 120.0,
        "--transfer-timeout": 90.0, "--schedule-policy": "lpm",
        "--pool-pages": 1024, "--metadata-slots": 96, "--waiting-timeout": 150.0,
        "--max-body-bytes": 4 << 20, "--bootstrap-port": 9000, "--stream-interval": 4,
        "--log-level": "warning", "--log-format": "json",
    }
    # Given only with --enable-prefill-delayer (None: not given), so its help says it.
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    assert "(default: 12, 11 passes)" in " ".join(parser.format_help().split())


def test_a_configuration_that_keeps_lost_managers_by_default_defaults_the_flag_to_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--retire-lost-prefill-after 0`` is the field's None (keep every manager)."""
    monkeypatch.setattr(kv.mooncake_engine, "MooncakeConfig",
                        drifted(MooncakeConfig, retire_lost_after_s=None))
    assert defaulted().retire_lost_prefill_after == 0.0
