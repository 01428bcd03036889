"""The API translators and the pieces of the llamacpp prompt path that need no process: each
API's request in OpenAI's words, the fields refused by name, the tool template's rendering."""

from __future__ import annotations

import json
import time

import jinja2
import pytest

from libs.contracts import GenerationRequest, Prompt, Sampling
from libs.models.shipped import gguf_path
from services.gateway.anthropic.protocol import MessagesRequest
from services.gateway.anthropic.serving import openai_request
from services.gateway.core.errors import ApiError
from services.gateway.ollama.protocol import ChatBody
from services.gateway.ollama.serving import chat_request
from services.gateway.openai.protocol import ChatCompletionRequest, unsupported
from services.gateway.openai.serving import chat_ask
from services.worker.device.prompts import refusal
from services.worker.served.chat_templates import own_template, tool_template
from services.worker.served.llama_prompts import Calls, request_body

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {}}}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_named_tool_choice_forces_that_tool_and_names_the_fields_to_refuse() -> None:
    ask = chat_ask(
        chat(tools=[TOOL, OTHER], tool_choice={"type": "function", "function": {"name": "other"}})
    )
    assert ask.body["tool_choice"] == "required"
    assert [t["function"]["name"] for t in ask.body["tools"]] == ["other"]
    assert ask.fields == ("tools",)
    with pytest.raises(ApiError, match="not in tools"):
        chat_ask(chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}))
    assert chat_ask(chat(tools=[TOOL], tool_choice="none")).fields == ()


def test_fields_no_engine_honours_are_named() -> None:
    assert unsupported(chat(functions=[{"name": "f"}])) == (
        "functions",
        "deprecated by OpenAI; send tools",
    )
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": image}]}
    )
    assert unsupported(request) == ("messages[0].content", "image_url parts are not supported")
    with pytest.raises(ValueError, match="made_up"):
        chat(made_up=1)


def test_anthropic_tool_use_and_results_become_openai_tool_calls_and_messages() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 100_000,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"a": 1}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sun"}],
                },
            ],
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
        }
    )
    request = openai_request(body)
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    (call,) = request.messages[2].tool_calls or []
    assert json.loads(call.function.arguments) == {"a": 1} and request.tool_choice == "required"
    assert request.messages[3].tool_call_id == "t1" and request.max_tokens == 4096


def test_ollama_options_map_to_openai_fields_or_are_refused_by_name() -> None:
    body = ChatBody.model_validate(
        {
            "model": "m:latest",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 0, "num_predict": 5, "num_ctx": 4096, "seed": 3},
            "format": {"type": "object"},
        }
    )
    request = chat_request(body)
    assert (request.model, request.max_tokens, request.seed) == ("m", 5, 3)
    assert request.response_format is not None and request.response_format.type == "json_schema"
    odd = body.model_copy(update={"options": {"mirostat": 1}})
    with pytest.raises(ApiError, match=r"options\.mirostat"):
        chat_request(odd)


def test_an_engine_of_token_ids_refuses_a_field_by_name_and_runs_a_plain_prompt() -> None:
    def request(fields: tuple[str, ...], ids: tuple[int, ...] = (1, 2)) -> GenerationRequest:
        prompt = Prompt(kind="chat", body='{"messages": []}', fields=fields)
        return GenerationRequest(
            request_id="r1",
            deployment_id="d",
            epoch=1,
            prompt_token_ids=ids,
            prompt=prompt,
            ts=time.time(),
        )

    refused = refusal(request(("tools",)), "torch")
    assert refused is not None and refused.invalid == "tools" and "torch" in (refused.error or "")
    assert refusal(request(()), "torch") is None
    no_ids = refusal(request((), ()), "vllm")
    assert no_ids is not None and no_ids.invalid == "model"


def test_the_tool_template_renders_plain_chats_as_the_models_own_and_tools_as_hermes() -> None:
    path, tools = tool_template(gguf_path())
    own = own_template(gguf_path())
    assert path is not None and tools and own is not None
    env = jinja2.Environment()
    wrapped, original = env.from_string(path.read_text()), env.from_string(own)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert wrapped.render(messages=plain, add_generation_prompt=True) == original.render(
        messages=plain, add_generation_prompt=True
    )
    call = {"function": {"name": "w", "arguments": "{}"}}
    history = [*plain, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = wrapped.render(messages=history, tools=[TOOL], add_generation_prompt=True)
    assert "<tools>" in rendered and '<tool_call>\n{"name": "w"' in rendered


def test_tool_call_pieces_are_joined_whole_and_the_owners_sampling_wins() -> None:
    calls = Calls()
    calls.add({"index": 0, "id": "c1", "function": {"name": "get_", "arguments": '{"ci'}})
    calls.add({"index": 0, "function": {"name": "weather", "arguments": 'ty": "P"}'}})
    (whole,) = calls.whole()
    assert (whole.id, whole.name, json.loads(whole.arguments)) == (
        "c1",
        "get_weather",
        {"city": "P"},
    )
    prompt = Prompt(kind="chat", body=json.dumps({"messages": [], "n": 2, "seed": 1}))
    body = request_body(prompt, Sampling(max_tokens=7, temperature=0.5, seed=9))
    assert "n" not in body and body["seed"] == 9 and body["max_tokens"] == 7 and body["stream"]
