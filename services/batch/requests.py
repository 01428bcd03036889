"""One request of a batch, run by a Celery worker (the task ``tessera.request``).

The worker claims the task (``{p}:batch:req:<task>``, set once: a redelivered task, or one the
gateway's runner gave up on, is skipped), beats while it runs it, sends it to the gateway's
serving path with the runner's key and the task id in ``REQUEST_HEADER``, and writes what came
back for the runner (``libs/contracts/batch_requests.py`` has the keys). A worker killed
mid-request stops beating: the runner sends the request again as a new task, and its answer is
kept once whichever copy answers first. A training run is trained here instead of sent
(``train_runs.py``), under the same claim and beat.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
from redis import Redis
from redis.exceptions import RedisError

from libs.contracts.batch_requests import (
    ALIVE_S,
    BEAT_S,
    DEVICES_HEADER,
    KEEP_S,
    REQUEST_HEADER,
    Answer,
    alive_key,
    answer_key,
    answer_of,
    claim_key,
    dumps,
    steps_key,
    stop_key,
)

#: Claim the task (once, ``NX``) and, only then, mark it alive: one step, so a claim is never
#: seen without its beat, and a second delivery that finds the claim taken touches nothing.
CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
    redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
    return 1
end
return 0
"""


def run_request(
    redis: Redis, prefix: str, task_id: str, worker: str, work: Callable[[], Answer]
) -> bool:
    """Run the task once (``work``: ``send`` it, or train it); False when it was claimed
    already (nothing run)."""
    alive = alive_key(prefix, task_id)
    keys = [claim_key(prefix, task_id), alive]
    if not redis.eval(CLAIM, 2, *keys, worker, KEEP_S, int(ALIVE_S)):
        return False
    done = threading.Event()

    def beat() -> None:
        while not done.wait(BEAT_S):
            try:
                redis.set(alive, worker, ex=int(ALIVE_S))
            except RedisError:  # out for a moment: beat again at the next second
                continue

    beating = threading.Thread(target=beat, name=f"beat-{task_id}", daemon=True)
    beating.start()
    try:
        answer = work()
        redis.set(answer_key(prefix, task_id), dumps(answer), ex=KEEP_S)
    finally:
        done.set()
        beating.join()
        redis.delete(alive)
    return True


def stopped(redis: Redis, prefix: str, task_id: str) -> bool:
    """Whether the runner stopped the task (Redis out for a moment: not as far as we know)."""
    try:
        return bool(redis.exists(stop_key(prefix, task_id)))
    except RedisError:
        return False


def report_steps(redis: Redis, prefix: str, run: str, step: int) -> None:
    """A training run's last step, for the runner's progress (Redis out: the next one)."""
    try:
        redis.set(steps_key(prefix, run), step, ex=KEEP_S)
    except RedisError:
        return


def send(gateway: httpx.Client, task_id: str, endpoint: str, body: dict[str, Any]) -> Answer:
    """The gateway's answer; 503 when it could not be reached (the runner sends it again)."""
    try:
        response = gateway.post(endpoint, json=body, headers={REQUEST_HEADER: task_id})
    except httpx.HTTPError as exc:
        return 503, {"error": {"message": f"the gateway did not answer: {exc!r}"}}, []
    return answer_of(response.status_code, response.text, response.headers.get(DEVICES_HEADER, ""))
