"""The gateway holds each client to its rate: past its burst a client gets 429 with Retry-After
in OpenAI's error shape, while another client is still served."""

from __future__ import annotations

import httpx

from libs.cluster.servers import NatsServer, RedisServer
from libs.runtime.procs import free_port
from tests.processes import GATEWAY_STOPPED, ServiceProcess


def start_gateway(
    nats_server: NatsServer, redis_server: RedisServer, **env: str
) -> tuple[int, ServiceProcess]:
    """A gateway on the tests' servers with ``env``, and no scheduler behind it."""
    port = free_port()
    gateway = ServiceProcess(
        "gateway",
        {
            "TESSERA_NATS_URL": nats_server.url,
            "TESSERA_REDIS_URL": redis_server.url,
            "TESSERA_GATEWAY_PORT": str(port),
            "TESSERA_GATEWAY_SCHEDULER_URL": f"http://127.0.0.1:{free_port()}",  # none there
            **env,
        },
    ).start()
    return port, gateway


def test_a_client_over_its_rate_gets_429_and_others_are_served(
    nats_server: NatsServer, redis_server: RedisServer
) -> None:
    port, gateway = start_gateway(
        nats_server,
        redis_server,
        TESSERA_GATEWAY_API_KEYS='["sk-greedy", "sk-polite"]',
        TESSERA_GATEWAY_RATE_PER_S="0.2",
        TESSERA_GATEWAY_RATE_BURST="3",
    )
    url = f"http://127.0.0.1:{port}/v1/models"
    try:
        greedy = {"Authorization": "Bearer sk-greedy"}
        statuses = [httpx.get(url, headers=greedy, timeout=10).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        refused = httpx.get(url, headers=greedy, timeout=10)
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["Retry-After"]) <= 5
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        polite = httpx.get(url, headers={"Authorization": "Bearer sk-polite"}, timeout=10)
        assert polite.status_code == 200
        # A wrong key is refused as such and spends nobody's rate.
        assert httpx.get(url, headers={"Authorization": "Bearer x"}, timeout=10).status_code == 401
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'status="429"' in metrics
        assert "sk-greedy" not in metrics and "sk-greedy" not in str(gateway.lines)
    finally:
        assert gateway.stop() in GATEWAY_STOPPED


def test_the_batch_runners_key_is_taken_on_the_serving_endpoints_only(
    nats_server: NatsServer, redis_server: RedisServer
) -> None:
    """A batch worker holds the runner's key: with it, requests are served, but no file,
    batch, model or admin call answers."""
    port, gateway = start_gateway(
        nats_server,
        redis_server,
        TESSERA_GATEWAY_API_KEYS='["sk-user"]',
        TESSERA_GATEWAY_BATCH_RUNNER_KEY="tsk-batch-test",
    )
    base = f"http://127.0.0.1:{port}"
    runner = {"Authorization": "Bearer tsk-batch-test"}
    try:
        chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
        served = httpx.post(f"{base}/v1/chat/completions", json=chat, headers=runner, timeout=10)
        assert served.status_code == 404, served.text  # past the key: no such model here
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/v1/files"),
            ("GET", "/v1/batches"),
            ("POST", "/v1/batches"),
            ("GET", "/api/tags"),
        ]:
            refused = httpx.request(method, f"{base}{path}", headers=runner, timeout=10)
            assert refused.status_code == 403, (path, refused.text)
            assert "only" in str(refused.json()["error"])  # (Ollama's paths: its error shape)
        user = {"Authorization": "Bearer sk-user"}
        assert httpx.get(f"{base}/v1/models", headers=user, timeout=10).status_code == 200
    finally:
        assert gateway.stop() in GATEWAY_STOPPED


def test_a_gateway_with_no_batch_worker_refuses_a_training_job_saying_why(
    nats_server: NatsServer, redis_server: RedisServer
) -> None:
    """Training runs are trained by batch workers: a gateway that sends its batches through
    itself (no broker) refuses a training job at once, naming the setting, and makes no batch."""
    from libs.cli.job_commands import training_runs

    port, gateway = start_gateway(nats_server, redis_server, TESSERA_GATEWAY_API_KEYS='["sk-u"]')
    base, user = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-u"}
    try:
        files = {"file": ("t.jsonl", training_runs(1, 10, 5), "application/jsonl")}
        uploaded = httpx.post(
            f"{base}/v1/files", data={"purpose": "batch"}, files=files, headers=user, timeout=10
        ).json()
        body = {"input_file_id": uploaded["id"], "endpoint": "/v1/tessera/train",
                "completion_window": "1h"}  # fmt: skip
        before = httpx.get(f"{base}/v1/batches", headers=user, timeout=10).json()["data"]
        refused = httpx.post(f"{base}/v1/batches", json=body, headers=user, timeout=10)
        assert refused.status_code == 400, refused.text
        assert "TESSERA_GATEWAY_BATCH_BROKER_URL" in refused.json()["error"]["message"]
        after = httpx.get(f"{base}/v1/batches", headers=user, timeout=10).json()["data"]
        assert after == before
    finally:
        assert gateway.stop() in GATEWAY_STOPPED
