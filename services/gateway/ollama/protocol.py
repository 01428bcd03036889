"""Ollama's request shapes (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/pull``,
``/api/show``) and its names of models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.openai.embeddings import Input

Text = Annotated[str, Field(max_length=200_000)]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(max_length=64)]
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[str] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: Annotated[str, Field(max_length=64)] | None = None


class BaseBody(BaseModel):
    """The fields ``/api/chat`` and ``/api/generate`` share."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    stream: bool = True
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatBody(BaseBody):
    messages: Annotated[list[ChatMessage], Field(max_length=256)] = Field(default_factory=list)
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None


class GenerateBody(BaseBody):
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    input: Input | Annotated[list[Input], Field(min_length=1, max_length=64)]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None
    dimensions: Annotated[int, Field(ge=1, le=65536)] | None = None


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    insecure: bool | None = None
    stream: bool = True


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=128)]
    verbose: bool | None = None


def model_name(name: str) -> str:
    """Ollama's clients name ``model:latest``; the deployment is ``model``."""
    return name.removesuffix(":latest") or name
