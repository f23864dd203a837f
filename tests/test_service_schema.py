"""Schemathesis against the published OpenAPI schema, in process (ASGI): whatever it sends,
no 5xx, and every answer conforms to the schema (status, content type, body)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.app import create_app
from scheduler.service.core import ServeConfig
from tests.service_harness import idle, running_service

CONFIG = ServeConfig(
    role="both", backend="local", model=ModelConfig.tiny(),
    scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16), pool_pages=64,
    metadata_slots=8, max_new_tokens_limit=8, max_body_bytes=64 << 10,
)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def service_app() -> Iterator[tuple[Any, Any]]:
    with running_service(CONFIG) as service:
        yield service, create_app(service)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_every_answer_conforms_to_the_schema(service_app: tuple[Any, Any],
                                             mode: GenerationMode) -> None:
    service, app = service_app
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=100)
    def call(case: Any) -> None:
        case.call_and_validate(checks=CHECKS)

    call()
    assert service.healthy


def test_the_service_is_left_idle(service_app: tuple[Any, Any]) -> None:
    service = service_app[0]
    assert service.wait_drained(30)
    assert service.healthy
    # The engine loop publishes its snapshot after the pass that released the last request.
    from tests.service_harness import wait_for

    wait_for(lambda: idle({"live_requests": 0, **service.snapshot}), 10, "pools free")
