"""The gateway with the official `openai` client against `tessera up` running SmolLM2, on the
cluster the e2e tests share (``tests/e2e/shared.py``: its limits are the ones asserted here).
What breaks or reconfigures a cluster (killed workers, the OpenAPI fuzzing, which may change
the policy or add models) is in ``test_gateway_failures.py``, on a cluster of its own."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest

from tests.e2e import shared
from tests.e2e.cluster import RunningCluster

MODEL = "smollm2-135m-instruct"
KEY = shared.KEYS[1]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cluster(shared_cluster: RunningCluster) -> RunningCluster:
    return shared_cluster


@pytest.fixture
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=KEY, max_retries=0)


def ask(client: openai.OpenAI, text: str, **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **kw
    )


def test_ready_is_said_only_after_the_model_answered_so_a_first_request_finds_it_warm(
    cluster: RunningCluster, client: openai.OpenAI
) -> None:
    # `ready` is printed only after the model answered a request through the gateway, so the
    # first user request finds its shards loaded and warm (its wait is printed, not asserted:
    # a wall-time bound fails on a busy machine, not on a wrong cluster).
    said = cluster.lines
    answered = next(i for i, line in enumerate(said) if "answered in" in line)
    ready = next(i for i, line in enumerate(said) if "ready:" in line)
    assert answered < ready, said[answered : ready + 1]
    sent = time.monotonic()
    stream = ask(client, "Hello!", max_tokens=4, temperature=0, stream=True)
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    waited = time.monotonic() - sent
    stream.close()
    assert first.choices[0].delta.content
    print(f"first token after {waited:.2f} s")


def test_models_lists_the_deployed_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_streaming_and_completions(client: openai.OpenAI) -> None:
    # SmolLM2's 4-bit GGUF (the llamacpp engine) answers "What is the capital of France?" with
    # "L'Étoile, la Marseillaise…"; asked this way, it says Paris.
    reply = ask(client, "Name the capital of France.", max_tokens=12, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stream = ask(
        client,
        "Name the capital of France.",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(parts) == reply.choices[0].message.content  # greedy: the same text
    assert finish == reply.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens
    text = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens <= 6


def test_errors_are_typed_openai_errors(cluster: RunningCluster, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not deployed"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ask(client, "x", temperature=7)
    with pytest.raises(openai.BadRequestError, match="context length"):
        ask(client, "word " * 3000, max_tokens=10)
    anonymous = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    with pytest.raises(openai.APIStatusError) as too_big:
        ask(client, "x" * 70_000)
    assert too_big.value.status_code == 413
    body = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert body.status_code == 400 and body.json()["error"]["type"] == "invalid_request_error"
    # Keys never show: not in any service's log, not in the metrics.
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert KEY not in metrics and KEY not in "\n".join(cluster.lines)


def test_more_requests_than_the_limit_get_429_with_retry_after(client: openai.OpenAI) -> None:
    streams = [ask(client, "Tell a long story.", max_tokens=200, stream=True) for _ in range(2)]
    for stream in streams:
        next(iter(stream))  # both are running now
    with pytest.raises(openai.RateLimitError) as refused:
        ask(client, "x", max_tokens=4)
    assert refused.value.response.headers["retry-after"] == "1"
    for stream in streams:
        stream.close()


async def test_a_burst_of_streams_past_the_limit_gets_429_for_the_excess(
    cluster: RunningCluster,
) -> None:
    """Six streams opened at once against a limit of two: a request counts as in flight from
    the moment it is admitted, not from its first token, so at most two get through."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 64,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))

        async def open_stream() -> int:
            request = http.build_request(
                "POST", f"{cluster.base_url}/v1/chat/completions", json=body, headers=headers
            )
            response = await http.send(request, stream=True)
            stack.push_async_callback(response.aclose)
            return response.status_code

        statuses = await asyncio.gather(*(open_stream() for _ in range(6)))
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) <= 2
    assert statuses.count(429) >= 4
