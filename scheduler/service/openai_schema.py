"""The bodies of the OpenAI endpoints, ``/v1/completions`` and ``/v1/chat/completions``
(pydantic models: the published schema).

Requests take OpenAI's fields, SGLang's extensions of them (``top_k``, ``min_p``, ``regex``,
``ebnf``, ``stop_token_ids``, ``ignore_eos``, ...), vLLM's names of the structured-output
constraints (``guided_json``, ``guided_choice``, ``structured_outputs``, ...) and the bootstrap
fields a PD router adds.
Unknown fields are ignored, as SGLang does (the router adds several); a known field pdlife
cannot honour is declared here with its neutral value so that :mod:`.openai_request` can refuse
anything else with a 400 that names it. ``null`` in any field is that field's default (OpenAI's
clients send ``null`` for an option their caller left ``None``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lifecycle import TOP_LOGPROBS_MAX
from scheduler.service.schema import StrictBody

#: OpenAI's bound on ``logprobs`` of ``/v1/completions``.
COMPLETION_LOGPROBS_MAX = 5

#: What ``response_format`` json_object asks for, as a JSON schema (SGLang's mapping).
JSON_OBJECT_SCHEMA = '{"type": "object"}'

Room = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]
Port = Annotated[int, Field(ge=0, le=65535)]


class _Body(StrictBody):
    # As /generate's: unknown fields ignored, null the default; fields also by their alias.
    model_config = ConfigDict(populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="a last chunk with the usage, no choices")


class JsonSchemaFormat(_Body):
    name: str = Field("schema", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema",
                                                  description="the JSON schema (required)")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema of the arguments (absent: no arguments, {})")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="the arguments, a JSON text")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: one of its constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    json_object: bool = Field(False, description="any JSON object")


class SamplingFields(_Body):
    """What both endpoints share: sampling, stops, logprob-free structured output, the PD
    router's bootstrap fields, and the fields pdlife refuses unless neutral."""

    model: str | None = Field(None, description="echoed in the answer; any name is served")
    temperature: float = Field(1.0, ge=0, le=100, description="0: greedy (OpenAI's default: 1)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1: no limit")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=(1 << 64) - 1,
                             description="the same seed gives the same tokens")
    stop: str | list[str] | None = Field(None, description="strings that end the answer")
    stop_regex: str | list[str] | None = Field(
        None, description="SGLang's: regular expressions (Python re) that end the answer")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = Field(False, description="keep a matched stop in the text")
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = Field(None, description="a Lark grammar")
    # vLLM's names of the same constraints (clients written for vLLM send them).
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: regex")
    guided_grammar: str | None = Field(None, description="vLLM's: a grammar (ebnf)")
    guided_choice: list[str] | None = Field(None, min_length=1,
                                            description="vLLM's: the answer is one of these")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's newer form of the guided_ fields")
    n: int = Field(1, description="choices, 1 to 16 (checked with the sampling parameters)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rid: str | None = Field(None, max_length=256, description="request id; generated if absent")
    # The router sends a list of each (one per sample) when n > 1.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port] | None = None
    bootstrap_room: Room | list[Room] | None = None
    # null is each one's default (OpenAI's spec allows it).
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="default 0")
    repetition_penalty: float | None = Field(None, gt=0, le=2,
                                             description="SGLang's extension; default 1")
    min_tokens: int | None = Field(None, ge=0,
                                   description="SGLang's extension: min_new_tokens; default 0")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (a string) to a bias in -100..100")
    # Fields pdlife cannot honour: refused with 400 unless neutral.
    return_hidden_states: bool = False
    lora_path: Any = None
    spaces_between_special_tokens: bool | None = None

    def constraints(self) -> list[tuple[str, str, str]]:
        """The structured-output constraints given, each as ``(the field as sent, SGLang's
        name: json_schema, regex or ebnf, its source)``, in the order of the fields."""
        out: list[tuple[str, str, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            out.append(("response_format", "json_schema", JSON_OBJECT_SCHEMA))
        elif fmt is not None and fmt.type == "json_schema":
            schema = None if fmt.json_schema is None else fmt.json_schema.schema_
            out.append(("response_format", "json_schema",
                        "" if schema is None else json.dumps(schema)))
        so = self.structured_outputs
        fields: tuple[tuple[str, str, dict[str, Any] | str | list[str] | None], ...] = (
            ("regex", "regex", self.regex), ("ebnf", "ebnf", self.ebnf),
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_grammar", "ebnf", self.guided_grammar),
            ("guided_choice", "ebnf", self.guided_choice),
            ("structured_outputs.json", "json_schema", None if so is None else so.json_),
            ("structured_outputs.json_object", "json_schema",
             JSON_OBJECT_SCHEMA if so is not None and so.json_object else None),
            ("structured_outputs.regex", "regex", None if so is None else so.regex),
            ("structured_outputs.grammar", "ebnf", None if so is None else so.grammar),
            ("structured_outputs.choice", "ebnf", None if so is None else so.choice))
        for field, kind, value in fields:
            if value is None:
                continue
            if isinstance(value, list):  # a choice: the answer is one of the strings
                source = "start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                for c in value)
            else:
                source = value if isinstance(value, str) else json.dumps(value)
            out.append((field, kind, source))
        return out


class CompletionRequest(SamplingFields):
    """``/v1/completions``: a prompt (text or token ids) or a batch of them."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a prompt (a string or token ids) or a list of them (a batch)")
    max_tokens: int = Field(16, ge=0, description="0: the prompt alone (with echo, its text "
                            "and logprobs), no token")
    logprobs: int | None = Field(None, ge=0, le=COMPLETION_LOGPROBS_MAX,
                                 description="alternatives per token; 0: the chosen token only")
    echo: bool = Field(False, description="the prompt's text (and logprobs) before the answer")
    # Refused unless neutral.
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class RefusalPart(_Body):
    """An assistant's refusal in its content (OpenAI's history form): its text is the
    message's, as a text part's is. OpenAI takes it in assistant messages only; another role's
    is refused as the request is built."""

    type: Literal["refusal"]
    refusal: str


class OtherPart(_Body):
    """A content part of another kind (an image, audio, a file): refused by name, as pdlife
    serves text models."""

    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | RefusalPart | OtherPart] | None = None
    name: str | None = None
    # An assistant's calls, and the call a tool message answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``/v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="default: what the "
                                              "context and the server's limit leave")
    max_tokens: int | None = Field(None, ge=1, description="older name of the above")
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=TOP_LOGPROBS_MAX, description="needs logprobs")
    # Accepted and without effect: pdlife has no reasoning parser.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = Field(True, description="with required: more than one call")
    # Refused unless neutral.
    continue_final_message: bool = False
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None


# -- answers ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None  # null at an echoed prompt's first token
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # OpenAI writes tool_calls only in a message that makes calls.
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail

    @classmethod
    def of(cls, status: int, message: str, code: str, param: str | None = None) -> OpenAIError:
        """The error for an HTTP ``status``: ``type`` ``invalid_request_error`` for a 4xx,
        ``server_error`` otherwise (a stream's error event carries it too)."""
        kind = "invalid_request_error" if status < 500 else "server_error"
        return cls(error=OpenAIErrorDetail(message=message, type=kind, param=param, code=code))


OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": OpenAIError, "description": "the request can never be served as sent"},
    413: {"description": "the body exceeds the server's limit"},
    500: {"model": OpenAIError, "description": "bootstrap, transfer or internal failure"},
    503: {"model": OpenAIError, "description": "draining, or the engine loop failed"},
}
