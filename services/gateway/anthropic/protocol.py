"""Anthropic's Messages API shapes: the request (an unknown field is refused, as Anthropic
does) and the message it answers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Text = Annotated[str, Field(max_length=200_000)]


class Block(BaseModel):
    """A content block: ``text``, ``tool_use``, ``tool_result``; others (images, documents,
    thinking) are refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(max_length=64)]
    text: Text | None = None
    id: Annotated[str, Field(max_length=128)] | None = None
    name: Annotated[str, Field(max_length=128)] | None = None
    input: dict[str, Any] | None = None
    tool_use_id: Annotated[str, Field(max_length=128)] | None = None
    content: Text | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=256)]


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, Field(max_length=10_000)] | None = None
    input_schema: dict[str, Any]


class ToolChoiceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(max_length=64)] | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    """Anthropic's request; an unknown field is refused, as Anthropic does."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=256)]
    system: Text | list[Block] | None = None
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
        | None
    ) = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1, le=1000)] | None = None
    stream: bool = False
    tools: Annotated[list[ToolIn], Field(max_length=128)] | None = None
    tool_choice: ToolChoiceIn | None = None
    metadata: dict[str, Any] | None = None
    #: ``format`` (a JSON schema: the output is constrained to it); ``effort`` is a hint the
    #: engines here have no use for.
    output_config: OutputConfig | None = None
    # Hints with nothing to act on here (caching is by prefix anyway), accepted.
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Anthropic's, honoured by no engine here: refused by name.
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: dict[str, int]
