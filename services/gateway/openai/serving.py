"""OpenAI's requests as the request core's ``Ask`` (its answers' shapes are in ``responses``).

The other APIs (``anthropic``, ``ollama``) build an OpenAI request and come through here too,
so every API reaches the engines the same way.
"""

from __future__ import annotations

from typing import Any

from services.gateway.core.answers import MAX_TOKENS, Ask, sampling_for
from services.gateway.core.errors import ApiError
from services.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    unsupported,
)


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    found = unsupported(body)
    if found is not None:
        name, reason = found
        raise ApiError(400, f"{name}: {reason}", param=name, code="unsupported_field")


def _sampling_fields(
    body: ChatCompletionRequest | CompletionRequest,
) -> tuple[dict[str, Any], list[str]]:
    """The penalties and biases (llama.cpp honours them; an engine of ids does not)."""
    fields: dict[str, Any] = {}
    names: list[str] = []
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
            if value != 0:
                names.append(name)
    if body.logit_bias:
        for token, bias in body.logit_bias.items():
            number = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not (token.isdigit() and len(token) < 10 and number and -100 <= bias <= 100):
                message = "logit_bias: token ids (digits) to numbers from -100 to 100"
                raise ApiError(400, message, param="logit_bias")
        fields["logit_bias"] = body.logit_bias
        names.append("logit_bias")
    return fields, names


def chat_ask(body: ChatCompletionRequest) -> Ask:
    """A chat completion's ``Ask`` (``refuse_unsupported`` first)."""
    messages: list[dict[str, Any]] = []
    names: list[str] = []
    for message in body.messages:
        out = message.model_dump(exclude_none=True)
        if message.role == "developer":  # OpenAI's newer name for the system prompt
            out["role"] = "system"
        if message.tool_calls:
            names.append("messages.tool_calls")
        if message.role == "assistant" and message.content is None:
            out["content"] = ""
        messages.append(out)
    fields, more = _sampling_fields(body)
    names += more
    engine: dict[str, Any] = {"messages": messages, **fields}
    tools = body.tools
    choice = body.tool_choice
    if tools and choice != "none":
        if isinstance(choice, NamedToolChoice):  # llama.cpp takes none, auto or required
            named = [t for t in tools if t.function.name == choice.function.name]
            if not named:
                missing = f"tool_choice names {choice.function.name!r}, which is not in tools"
                raise ApiError(400, missing, param="tool_choice")
            tools, choice = named, "required"
        engine["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        engine["tool_choice"] = choice or "auto"
        names.append("tools")
        if body.parallel_tool_calls is not None:
            engine["parallel_tool_calls"] = body.parallel_tool_calls
    format_ = body.response_format
    as_json = format_ is not None and format_.type != "text"
    if format_ is not None and as_json:
        if body.stop:  # it could end the text inside the object: it would not parse
            cut = "stop: a stop sequence could cut the JSON that response_format asks for"
            raise ApiError(400, cut, param="stop")
        engine["response_format"] = format_.model_dump(exclude_none=True, by_alias=True)
        names.append("response_format")
    if body.logprobs:
        engine["logprobs"] = True
        engine["top_logprobs"] = body.top_logprobs or 0
        names.append("logprobs")
    elif body.top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    plain = [
        {"role": m["role"], "content": message.text()}
        for m, message in zip(messages, body.messages, strict=True)
    ]
    max_tokens = body.max_completion_tokens or body.max_tokens
    # JSON without a limit gets the room left in the context, as OpenAI gives it (not the
    # default 256 a chat gets), so the object ends whole unless the context runs out; a
    # limit that cuts it is reported as "length", never "stop".
    fit = as_json and max_tokens is None
    return Ask(
        kind="chat",
        model=body.model,
        body=engine,
        fields=tuple(dict.fromkeys(names)),
        sampling=sampling_for(
            MAX_TOKENS if fit else max_tokens,
            body.temperature,
            body.top_p,
            body.stops(),
            body.seed,
        ),
        n=body.n,
        plain=plain,
        fit=fit,
    )


def text_ask(body: CompletionRequest) -> Ask:
    fields, names = _sampling_fields(body)
    engine: dict[str, Any] = {"prompt": body.text(), **fields}
    if body.logprobs:
        engine["logprobs"] = body.logprobs
        names.append("logprobs")
    return Ask(
        kind="text",
        model=body.model,
        body=engine,
        fields=tuple(names),
        sampling=sampling_for(
            body.max_tokens or 16, body.temperature, body.top_p, body.stops(), body.seed
        ),
        n=body.n,
        plain=body.text(),
    )
