"""OpenAI's request shapes (the subset Tessera serves) and the fields no engine here honours;
the answers' shapes are in ``responses``, the error shape in ``core.errors``."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.core.answers import MAX_TOKENS

#: Choices one request may ask for (``n``): each is a generation of its own.
MAX_CHOICES = 8

Text = Annotated[str, Field(max_length=200_000)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """A part OpenAI accepts that no engine here reads (images, audio, files): refused by
    name once the model is known (``unsupported``), never dropped."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    arguments: Annotated[str, Field(max_length=200_000)]


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: (
        Text | Annotated[list[TextPart | OtherPart], Field(min_length=1, max_length=64)] | None
    ) = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=64)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    refusal: Text | None = None

    def text(self) -> str:
        """The content as one string (its text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    description: Annotated[str, Field(max_length=10_000)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ToolName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolName


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Name
    description: Annotated[str, Field(max_length=10_000)] | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Common(BaseModel):
    """Fields shared by chat and text completions. An unknown field is refused (400 naming
    it), as OpenAI does; OpenAI's fields that no engine here honours are named in
    ``REFUSED`` and refused once the model is known, with the reason."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: (
        Annotated[str, Field(min_length=1, max_length=256)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
        | None
    ) = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    #: Token ids (digits) to biases in [-100, 100], checked once the model is known
    #: (``serving``): JSON Schema's key patterns are not kept by every client generator.
    logit_bias: Annotated[dict[str, Any], Field(max_length=300)] | None = None
    metadata: Annotated[dict[str, Any], Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=256)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # OpenAI's, honoured by no engine here: refused by name (``REFUSED``).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class CompletionRequest(_Common):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    # OpenAI's, honoured by no engine here: refused by name (``REFUSED``).
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=0, le=20)] | None = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


#: OpenAI's fields no engine here honours, and why (refused with 400 when set).
REFUSED = {
    "functions": "deprecated by OpenAI; send tools",
    "function_call": "deprecated by OpenAI; send tool_choice",
    "audio": "no engine here produces audio",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "no engine here searches the web",
    "reasoning_effort": "not supported by the engines here",
    "verbosity": "not supported by the engines here",
    "echo": "echoing the prompt is not supported",
    "suffix": "insertion (suffix) is not supported",
}


def unsupported(body: _Common) -> tuple[str, str] | None:
    """The first field of ``body`` that no engine here honours, and why (None: none)."""
    for name, reason in REFUSED.items():
        value = getattr(body, name, None)
        if value not in (None, False):
            return name, reason
    if getattr(body, "best_of", None) not in (None, 0, 1):
        return "best_of", "best_of is not supported; send n"
    modalities = getattr(body, "modalities", None)
    if modalities and set(modalities) != {"text"}:
        return "modalities", "only text is produced here"
    if body.store:
        return "store", "completions are not stored here"
    for i, message in enumerate(getattr(body, "messages", ())):
        if isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, OtherPart):
                    return f"messages[{i}].content", f"{part.type} parts are not supported"
    return None


def now_s() -> int:
    return int(time.time())
