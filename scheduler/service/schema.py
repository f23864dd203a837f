"""The bodies of the ``pdlife serve`` HTTP API (pydantic models: the published schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Room = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]


class _Strict(BaseModel):
    # Unknown fields (the router adds several) are ignored; known ones must have their type.
    model_config = ConfigDict(extra="ignore", strict=True)


class SamplingParamsBody(_Strict):
    """``sampling_params`` of a ``/generate`` body (SGLang's): greedy decoding; other SGLang
    sampling fields are accepted and ignored."""

    max_new_tokens: int = Field(default=16, ge=1, description="at most the server's limit")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False


class GenerateRequest(_Strict):
    """SGLang's ``/generate`` input: one prompt, or a batch as lists."""

    text: str | list[str] | None = Field(None, description="prompt text (byte-level tokens)")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="prompt token ids")
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = Field(
        None, description="one for every prompt, or a list with one per prompt of a batch"
    )
    return_logprob: bool = Field(False, description="not supported: true is refused with 400")
    stream: bool = Field(False, description="server-sent events, ending with data: [DONE]")
    rid: str | list[str] | None = Field(None, description="request id(s); generated if absent")
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Annotated[int, Field(ge=0, le=65535)] | list[
        Annotated[int, Field(ge=0, le=65535)]] | None = None
    bootstrap_room: Room | list[Room] | None = None


class FinishReason(BaseModel):
    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | None = None
    message: str | None = None
    status_code: int | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache


class GenerateAnswer(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class ErrorDetail(BaseModel):
    message: str
    type: str
    rid: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class AbortBody(_Strict):
    """The body of ``/abort_request``: one request id, or every request."""

    rid: str = ""
    abort_all: bool = False


class AbortAnswer(BaseModel):
    rid: str
    aborted: int


class ServerInfo(BaseModel):
    role: str
    backend: str
    disaggregation_mode: str
    model_path: str
    page_size: int
    pool_pages: int
    metadata_slots: int
    max_new_tokens_limit: int
    max_position: int
    bootstrap_port: int | None
    healthy: bool
    draining: bool
    live_requests: int
    requests: dict[str, dict[str, int]]
    kv_pool: dict[str, dict[str, int]]
    peers: list[str]


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    vocab_size: int
    max_position: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "the request can never be served as sent"},
    413: {"model": ErrorBody, "description": "the body exceeds the server's limit"},
    500: {"model": ErrorBody, "description": "bootstrap, transfer or internal failure"},
    503: {"model": ErrorBody, "description": "draining, or the engine loop failed"},
}
