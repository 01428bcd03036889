"""What the gateway and the batch worker of ``tessera up`` are told of each other: the batches'
requests go from the gateway's runner through the Celery broker (Redis's db 1, as the user
``batch-sender``) to the batch worker (``python -m services.batch.worker``, as ``batch``), and
back to the gateway with the runner's key (drawn for each run). The worker keeps the training
runs' checkpoints in the cluster's home (``training/``), where a restarted one resumes them."""

from __future__ import annotations

from libs.cluster.access import AccessControl
from libs.cluster.home import Home
from libs.cluster.up_options import UpOptions


def batch_env(
    service: str,
    options: UpOptions,
    redis_url: str,
    access: AccessControl | None,
    key: str,
    home: Home | None = None,
) -> dict[str, str]:
    """The extra environment of ``service`` (none but the gateway's and the batch worker's)."""
    broker = redis_url.rsplit("/", 1)[0] + "/1"

    def as_user(user: str) -> str:
        return access.redis_url(broker, user) if access is not None else broker

    if service == "gateway":
        return {
            "TESSERA_GATEWAY_BATCH_BROKER_URL": as_user("batch-sender"),
            "TESSERA_GATEWAY_BATCH_RUNNER_KEY": key,
        }
    if service == "batch.worker":
        host = options.gateway_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        env = {
            "TESSERA_BATCH_BROKER_URL": as_user("batch"),
            "TESSERA_BATCH_GATEWAY_URL": f"http://{host}:{options.gateway_port}",
            "TESSERA_BATCH_GATEWAY_KEY": key,
        }
        return env | ({"TESSERA_BATCH_CHECKPOINT_DIR": str(home.training_dir)} if home else {})
    return {}
