"""The bodies of the ``pdlife serve`` HTTP API (pydantic models: the published schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifecycle import TOP_LOGPROBS_MAX

Room = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]


class StrictBody(BaseModel):
    # Unknown fields (the router adds several) are ignored; known ones must have their type,
    # or be null: the default (SGLang's fields are optional, None meaning the default).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            try:
                _refuse_lone_surrogates(data)
            except RecursionError:
                raise ValueError("the body is nested too deeply") from None
            return {key: value for key, value in data.items() if value is not None}
        return data


def _refuse_lone_surrogates(value: Any) -> None:
    """A string JSON carried as an unpaired ``\\ud800`` escape is no text: UTF-8 cannot write
    it (the tokenizer, the answer, the log would fail on it later)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"a string holds an unpaired surrogate ({exc.reason} at "
                             f"{exc.start}): not text") from None
    elif isinstance(value, dict):
        for item in value.values():
            _refuse_lone_surrogates(item)
    elif isinstance(value, list) and not (value and isinstance(value[0], int | float)):
        for item in value:  # (a list of numbers, token ids, holds no text)
            _refuse_lone_surrogates(item)


Stop = str | list[str] | None
TokenIds = list[Annotated[int, Field(ge=0)]] | None


class SamplingParamsBody(StrictBody):
    """``sampling_params`` of a ``/generate`` body, with SGLang's names. Decoding is greedy unless
    ``temperature`` > 0 (SGLang's default is 1.0; pdlife's is greedy). A field pdlife cannot
    honour (``structural_tag``, ``custom_params``, ...) is refused with 400 unless it has its
    neutral value; fields SGLang does not have are ignored."""

    max_new_tokens: int = Field(default=16, ge=0, description="at most the server's limit; "
                                "0: the prompt alone (its logprobs), no token")
    temperature: float = Field(default=0.0, ge=0, le=100, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, description="-1: no limit (0 is refused)")
    min_p: float = Field(default=0.0, ge=0, le=1)
    sampling_seed: int | None = Field(
        default=None, ge=0, le=(1 << 64) - 1,
        description="the seed of the sampled stream (default: the request's bootstrap room)")
    stop: Stop = Field(default=None, description="strings that end the answer")
    stop_token_ids: TokenIds = None
    ignore_eos: bool = False
    no_stop_trim: bool = Field(default=False, description="keep a matched stop in the text")
    skip_special_tokens: bool = True
    json_schema: str | None = Field(default=None, description="a JSON schema, as JSON text")
    regex: str | None = None
    ebnf: str | None = Field(default=None, description="a Lark grammar")
    n: int = Field(default=1, description="answers per prompt, 1 to 16")
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2,
                                     description="times each output token's count, subtracted")
    presence_penalty: float = Field(default=0.0, ge=-2, le=2,
                                    description="subtracted once a token is in the output")
    repetition_penalty: float = Field(default=1.0, gt=0, le=2,
                                      description="divides an output token's positive logit")
    min_new_tokens: int = Field(default=0, ge=0, description="no stop token or EOS before")
    logit_bias: dict[str, float] | None = Field(default=None,
                                                description="token id (a string) to bias")
    stop_regex: str | list[str] | None = Field(
        default=None, description="the answer ends where a match of one (Python re) begins")
    # SGLang fields pdlife cannot honour: refused with 400 unless neutral.
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    spaces_between_special_tokens: bool = True


class GenerateRequest(StrictBody):
    """SGLang's ``/generate`` input: one prompt, or a batch as lists."""

    text: str | list[str] | None = Field(None, description="prompt text (byte-level tokens)")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="prompt token ids")
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = Field(
        None, description="one for every prompt, or a list with one per prompt of a batch"
    )
    return_logprob: bool = Field(False, description="logprobs in meta_info")
    top_logprobs_num: int = Field(0, ge=0, le=TOP_LOGPROBS_MAX,
                                  description="alternatives per position")
    logprob_start_len: int = Field(-1, ge=-1, description="first prompt position with "
                                   "input logprobs; -1: none")
    return_text_in_logprobs: bool = Field(False, description="each logprob's token text")
    stream: bool = Field(False, description="server-sent events, ending with data: [DONE]")
    rid: str | list[str] | None = Field(None, description="request id(s); generated if absent")
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Annotated[int, Field(ge=0, le=65535)] | list[
        Annotated[int, Field(ge=0, le=65535)]] | None = None
    bootstrap_room: Room | list[Room] | None = None
    token_ids_logprob: list[Annotated[int, Field(ge=0)]] | list[
        list[Annotated[int, Field(ge=0)]]] | None = Field(
        None, description="with return_logprob: these ids' logprobs at every position (one "
        "list for every prompt, or one per prompt of a batch)")
    # SGLang fields pdlife cannot honour: refused with 400 unless absent.
    return_hidden_states: bool = False
    input_embeds: list[Any] | None = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None


class FinishReason(BaseModel):
    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | str | None = Field(default=None,
                                      description="the stop token id or stop string")
    message: str | None = None
    status_code: int | None = None


#: One position's logprob: ``[logprob, token_id, text]`` (text null unless asked for; the first
#: prompt token's logprob is null).
LogprobEntry = tuple[float | None, int, str | None]


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
    # With return_logprob (the top lists only with top_logprobs_num > 0): see docs/operations.md.
    input_token_logprobs: list[LogprobEntry] | None = None
    output_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # With token_ids_logprob: per position the named ids' entries, in their order (a logprob
    # that is not a number, an id a grammar forbids there, is null).
    input_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    output_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None


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


class AbortBody(StrictBody):
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
    # The served model's fingerprint (its weights' digest and dtype): the two workers of a pair
    # must show the same one.
    model_fingerprint: str | None
    page_size: int
    # The KV pool's layout (``--kv-layout``): a pair's workers must agree on it, as on the page
    # size.
    kv_layout: str
    pool_pages: int
    metadata_slots: int
    max_new_tokens_limit: int
    max_position: int
    bootstrap_port: int | None
    # The parallel layout (``--tp-size``, ``--pp-size``, ``--dp-size``) and the rank processes
    # it runs on, this one included.
    tp_size: int
    pp_size: int
    dp_size: int
    rank_processes: int
    healthy: bool
    draining: bool
    live_requests: int
    # Decode over Mooncake: requests not yet started (not in live_requests) because their
    # prefill server is being looked up, by its bootstrap address.
    connecting: dict[str, int]
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
