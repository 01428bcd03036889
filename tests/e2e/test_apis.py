"""OpenAI's, Anthropic's and Ollama's official clients against `tessera up` (llama.cpp engine,
the shipped SmolLM2 GGUF): every endpoint and field the gateway serves, on the cluster the
e2e tests share (``tests/e2e/shared.py``).

The tool calls come from a 135M model that knows no tools: with the tool forced, llama.cpp's
grammar makes its answer a valid call anyway. A tool call cut by a migration, which kills a
worker, is tested on a cluster of its own (``test_gateway_failures.py``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.e2e import shared
from tests.e2e.api_helpers import (
    FORCED,
    MODEL,
    PERSON,
    PERSON_CITY,
    WEATHER,
    chat,
    requests_counted,
    streamed_calls,
    traced,
)
from tests.e2e.cluster import RunningCluster

KEY = shared.KEYS[0]
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.timeout(600)
SPANS = shared.SPANS


@pytest.fixture
def cluster(shared_cluster: RunningCluster) -> RunningCluster:
    return shared_cluster


@pytest.fixture
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY, max_retries=0)


def test_chat_and_completions_streamed_and_not(client: Any) -> None:
    parts = [{"type": "text", "text": "Name the capital"}, {"type": "text", "text": " of France."}]
    reply = chat(client, parts, max_completion_tokens=12, temperature=0, seed=1)
    assert "Paris" in (reply.choices[0].message.content or "")
    usage = reply.usage
    assert usage is not None and 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stream = chat(
        client,
        "Name the capital of France.",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, streamed_usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        streamed_usage = chunk.usage or streamed_usage
    assert "".join(texts) == reply.choices[0].message.content  # greedy: the same answer
    assert finish == reply.choices[0].finish_reason
    assert (
        streamed_usage is not None and streamed_usage.completion_tokens == usage.completion_tokens
    )
    text = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens <= 6
    pieces = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices)


def test_stop_seed_n_and_logprobs(client: Any) -> None:
    stopped = chat(
        client, "Count from 1 to 10 with commas.", max_tokens=40, temperature=0, stop=["5"]
    )
    assert "5" not in (stopped.choices[0].message.content or "")
    same = [
        chat(client, "Tell me a word.", max_tokens=8, temperature=1.0, seed=42)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert same[0] == same[1]  # one seed, one answer
    two = chat(client, "Say hi.", max_tokens=6, temperature=0.8, n=2, seed=7)
    assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
    streamed = chat(client, "Say hi.", max_tokens=6, n=2, stream=True)
    seen = {c.choices[0].index for c in streamed if c.choices}
    assert seen == {0, 1}
    probed = chat(client, "Hi", max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = probed.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == probed.choices[0].message.content
    legacy = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, logprobs=2)
    assert legacy.choices[0].logprobs is not None and legacy.choices[0].logprobs.tokens


def test_a_tool_call_round_trip(client: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=FORCED, temperature=0
    )
    (call,) = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice=FORCED,
        temperature=0,
        stream=True,
    )
    calls, finish = streamed_calls(streamed)
    assert calls == [(call.function.name, call.function.arguments)] and finish == "tool_calls"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees."},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0
    )
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_json_schema_output_validates_for_twenty_prompts(client: Any) -> None:
    format_ = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for i in range(20):
        reply = chat(
            client,
            f"Invent person number {i} with a name and an age.",
            response_format=format_,
            # The grammar bounds each run of whitespace, so this many tokens always end it.
            max_tokens=400,
            temperature=0.7,
            seed=i,
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)


def test_json_object_output_parses_whenever_it_ends_by_itself(client: Any) -> None:
    """No schema: any object. An answer that ends by itself ("stop") always parses; a token
    limit that cuts it says "length". A stop sequence, which could cut it too, is refused."""
    stopped = 0
    for i in range(10):
        reply = chat(
            client,
            f"Describe city number {i} as a JSON object.",
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=0.7,
            seed=i,
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(choice.message.content or ""), dict)
    assert stopped >= 5  # most end by themselves: the check above is not empty
    with pytest.raises(openai.BadRequestError, match="stop") as cut:
        chat(client, "x", response_format={"type": "json_object"}, stop=["}"])
    assert cut.value.body["param"] == "stop"  # type: ignore[index]


def test_embeddings(client: Any) -> None:
    found = client.embeddings.create(model=MODEL, input=["hello", "a longer sentence here"])
    one, two = (d.embedding for d in found.data)
    assert len(one) == len(two) > 100 and one != two
    floats = client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(one, abs=1e-5)
    assert found.usage.prompt_tokens > 0


def test_fields_not_honoured_are_refused_by_name(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="functions") as known:
        chat(client, "x", functions=[{"name": "f"}])
    assert known.value.body["param"] == "functions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="made_up_field"):
        chat(client, "x", extra_body={"made_up_field": 1})
    with pytest.raises(openai.BadRequestError, match="image_url"):
        chat(client, [{"type": "image_url", "image_url": {"url": "data:,"}}])


def test_anthropic_messages_streamed_and_not_and_a_tool_use(cluster: RunningCluster) -> None:
    client: Any = anthropic.Anthropic(base_url=cluster.base_url, api_key=KEY, max_retries=0)
    greedy = {"extra_body": {"temperature": 0}}  # this SDK leaves sampling to the server
    question = [{"role": "user", "content": "Name the capital of France."}]
    reply = client.messages.create(
        model=MODEL, max_tokens=12, system="Answer briefly.", messages=question, **greedy
    )
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
    with client.messages.stream(
        model=MODEL, max_tokens=12, system="Answer briefly.", messages=question, **greedy
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text and final.usage.output_tokens == reply.usage.output_tokens
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": PERSON_CITY}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    used = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ask,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        **greedy,
    )
    (block,) = [b for b in used.content if b.type == "tool_use"]
    assert used.stop_reason == "tool_use" and block.name == "get_weather" and "city" in block.input
    after = client.messages.create(
        model=MODEL,
        max_tokens=30,
        tools=[tool],
        **greedy,
        messages=[
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny."}],
            },
        ],
    )
    assert after.content
    stranger: Any = anthropic.Anthropic(base_url=cluster.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=MODEL, max_tokens=4, messages=question)


def test_anthropic_stop_reason_names_the_stop_sequence(cluster: RunningCluster) -> None:
    client: Any = anthropic.Anthropic(base_url=cluster.base_url, api_key=KEY, max_retries=0)
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "Count from 1 to 10 with commas."}],
        "extra_body": {"temperature": 0},
    }
    free = client.messages.create(**ask)
    text = free.content[0].text
    assert "4" in text and free.stop_reason in ("end_turn", "max_tokens")
    word = text[text.index("4") :][:3]  # a stop sequence the answer reaches
    cut = client.messages.create(**ask, stop_sequences=["zebra", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]
    with client.messages.stream(**ask, stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    unmet = client.messages.create(**ask, stop_sequences=["zebra"])
    assert unmet.stop_reason == free.stop_reason and unmet.stop_sequence is None


def test_ollama_chat_generate_tags_show_version(cluster: RunningCluster) -> None:
    client: Any = ollama.Client(host=cluster.base_url, headers=AUTH)
    assert MODEL in [m.model for m in client.list().models]
    card = httpx.get(f"{cluster.base_url}/v1/cluster/models/{MODEL}", headers=AUTH).json()
    shown = client.show(MODEL)
    assert shown.details is not None and shown.details.family == card["architecture"]
    assert shown.details.parameter_size and shown.details.quantization_level in card["tensor_types"]
    assert shown.modelinfo["general.parameter_count"] == card["params"]
    assert shown.modelinfo[f"{card['architecture']}.context_length"] == card["context_train"]
    assert shown.template and shown.template == card.get("chat_template", shown.template)
    (loaded,) = [m for m in client.ps().models if m.model == MODEL]
    assert loaded.size == card["size_bytes"] and loaded.digest == card["sha256"]
    assert (
        loaded.context_length and loaded.details and loaded.details.family == card["architecture"]
    )
    ask = [{"role": "user", "content": "Name the capital of France."}]
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=MODEL, messages=ask, options=options)
    assert whole.message.content and whole.done and (whole.eval_count or 0) > 0
    streamed = list(client.chat(model=MODEL, messages=ask, options=options, stream=True))
    assert "".join(p.message.content or "" for p in streamed) == whole.message.content
    assert streamed[-1].done and streamed[-1].done_reason in ("stop", "length")
    generated = list(
        client.generate(
            model=MODEL, prompt="Name the capital of France.", options=options, stream=True
        )
    )
    assert "".join(p.response for p in generated) == whole.message.content  # the same template
    called = client.chat(
        model=f"{MODEL}:latest",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        # Capped: uncapped, SmolLM2 answers this in prose until the context is full (1,867
        # tokens, 50 s alone; the test took 126 s in CI).
        options={"temperature": 0, "num_predict": 64},
    )
    assert called.message.tool_calls is None or called.message.tool_calls[0].function.name
    vectors = client.embed(model=MODEL, input=["hello", "world"])
    assert len(vectors.embeddings) == 2
    version = httpx.get(f"{cluster.base_url}/api/version", headers=AUTH).json()
    assert version["version"]
    with pytest.raises(ollama.ResponseError, match=r"options\.mirostat"):
        client.chat(model=MODEL, messages=ask, options={"mirostat": 1})
    assert client.pull(MODEL).status == "success"  # it serves: here already
    assert [p.status for p in client.pull(MODEL, stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError, match="tessera models add") as unknown:
        client.pull("no-such-model")
    assert unknown.value.status_code == 404


def test_every_api_counts_in_the_metrics_and_is_traced(cluster: RunningCluster) -> None:
    """One request on each API's chat route: the gateway's request counter goes up by one
    under that route's own label, and a trace begins at its server span and goes on past
    the gateway (the request's spans on the other services)."""
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"max_tokens": 4},
        "/v1/messages": {"max_tokens": 4},
        "/api/chat": {"stream": False, "options": {"num_predict": 4}},
    }
    routes = tuple(bodies)
    before = requests_counted(cluster.base_url)
    sent = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    for route, extra in bodies.items():
        say = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], **extra}
        answer = httpx.post(cluster.base_url + route, json=say, headers=AUTH, timeout=120)
        assert answer.status_code == 200, answer.text
    after = requests_counted(cluster.base_url)
    for route in routes:
        assert after[(route, "200")] == before.get((route, "200"), 0) + 1, route
    found = traced(SPANS, sent, [f"POST {route}" for route in routes])
    for route in routes:
        services = found[f"POST {route}"]
        assert "tessera-gateway" in services and len(services) > 1, (route, services)
