"""The wire between the gateway's batch runner and the Celery workers that send its requests.

The runner (``services/gateway/batches/sender.py: CelerySender``) puts each request on the
queue ``QUEUE`` as the task ``TASK`` (a task id of its own); a worker
(``services/batch/requests.py``) sends it to the gateway's serving path with the runner's key
and ``REQUEST_HEADER`` (the task id: the gateway counts it as a batch request, not an
interactive one, and can preempt it), and writes what came back under ``answer_key``. In the
broker's Redis, with the prefix of the cluster's keys:

* ``{p}:batch:req:{task}``    who runs the task (set once, ``NX``), or ``abandoned``: a task
                              whose key is taken is never run again (a redelivery, or one the
                              runner gave up on);
* ``{p}:batch:alive:{task}``  set while a worker runs it, expiring ``ALIVE_S`` after the last
                              beat: a claimed task without it lost its worker;
* ``{p}:batch:answer:{task}`` the answer (JSON: status, body, devices), read once;
* ``{p}:batch:stop:{task}``   set by the runner when it stops the task (preempted, cancelled,
                              given up): a training run checkpoints and ends at its next step;
* ``{p}:batch:steps:{run}``   a training run's last step, written by the worker training it
                              (about once a second), read by the runner for the job's progress.

A training run (``TRAIN_ENDPOINT``, the job kind ``tessera jobs submit --train`` makes) is not
sent to the gateway: the worker trains it itself (``services/batch/training.py``), from the
run's last checkpoint, and answers with the result.
"""

from __future__ import annotations

import json
from typing import Any

#: The Celery queue of the batches' requests, and its task.
QUEUE = "batch.requests"
TASK = "tessera.request"
#: The training runs' endpoint, and the model they train (``services/batch/training.py``).
TRAIN_ENDPOINT = "/v1/tessera/train"
TRAIN_MODEL = "tessera-mlp"
#: The request header carrying the task id.
REQUEST_HEADER = "x-tessera-batch-request"
#: The response header naming the devices that answered a request that does not stream.
DEVICES_HEADER = "x-tessera-devices"
#: A worker beats every ``BEAT_S`` while it runs a task; a claim without a beat for
#: ``ALIVE_S`` has lost its worker.
BEAT_S = 1.0
ALIVE_S = 6.0
#: How long the claims and answers are kept (s).
KEEP_S = 86_400
#: What a claim holds once the runner gave the task up.
ABANDONED = "abandoned"

#: A request's outcome: its HTTP status, JSON answer and the devices that answered it.
Answer = tuple[int, dict[str, Any], list[str]]


def claim_key(prefix: str, task_id: str) -> str:
    return f"{prefix}:batch:req:{task_id}"


def alive_key(prefix: str, task_id: str) -> str:
    return f"{prefix}:batch:alive:{task_id}"


def answer_key(prefix: str, task_id: str) -> str:
    return f"{prefix}:batch:answer:{task_id}"


def stop_key(prefix: str, task_id: str) -> str:
    return f"{prefix}:batch:stop:{task_id}"


def steps_key(prefix: str, run: str) -> str:
    return f"{prefix}:batch:steps:{run}"


def answer_of(status: int, text: str, devices: str) -> Answer:
    """An HTTP answer as the runner keeps it: a body that is not a JSON object is wrapped."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = {"error": {"message": text[:500]}}
    named = [d for d in devices.split(",") if d]
    return status, parsed if isinstance(parsed, dict) else {"data": parsed}, named


def dumps(answer: Answer) -> str:
    status, body, devices = answer
    return json.dumps({"status": status, "body": body, "devices": devices})


def loads(stored: str | bytes) -> Answer:
    raw = json.loads(stored)
    return int(raw["status"]), dict(raw["body"]), [str(d) for d in raw["devices"]]
