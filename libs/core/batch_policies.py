"""The live policies of the Batch API: which batches are admitted, and how many of the
runner's streams (requests at once) each one gets now. Pure: ``now`` is passed in, and each
model's throughput is a measured curve (units/s by requests at once), never assumed.

- ``edf``: earliest deadline first. Admitted when, run one after the other in deadline order
  at every stream, it and each batch admitted before it end by their deadlines; the streams
  go to the earliest deadline first.
- ``fifo``: first come, first served. Admitted when it ends by its deadline after every batch
  that came before it; the streams go to the earliest arrival first.
- ``elasticflow``: ElasticFlow's plan (``elasticflow.py``, as its authors built it) with the
  runner's streams for GPUs: each batch gets its minimum satisfactory share (the fewest
  streams that end it by its deadline, given what the batches with earlier deadlines hold,
  slot by slot), the streams left over go one step up a batch's curve at a time by marginal
  gain; admitted when every batch's plan still meets its deadline. The curve is sub-linear
  (eight requests at once make fewer than eight times the tokens of one), which is what
  makes elastic shares pay.

- ``edgeflow``: EdgeFlow (``edgeflow.py``) as the simulator runs it by default: ElasticFlow's
  plan and admission on the cloud, untouched, and the edge for what the cloud declines. The
  cloud is the model's deployment its name means (the runner's streams, where chat goes too);
  each other deployment of the same model that serves (``tessera deploy M --id M-laptop
  --devices laptop-1``) is an edge server, with its own measured curve, running one batch at a
  time. A batch the cloud declines goes to an idle edge server on which it ends by its
  deadline (``edge_admission``, the slowest such one: the fast ones stay free for tighter
  batches) and stays there (rule 1); else it is declined with both reasons. Rules 2 and 3,
  made safe (``rescued``): an admitted batch the cloud's plan now has missing its deadline
  (its model measured slower than when it was admitted, say) goes to an idle edge server on
  which it still meets it, the least able first; a batch the cloud still ends in time never
  moves, so the edge only adds deadlines met.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from libs.core.deadlines import Admission, Work, admit, span
from libs.core.edgeflow import EdgeCandidate, EdgeServer, edge_admission
from libs.core.elasticflow import PlanJob, plan_all, share_leftover

POLICIES = ("edf", "fifo", "elasticflow", "edgeflow")
#: The policies whose cloud runs ElasticFlow's plan.
ELASTIC = ("elasticflow", "edgeflow")
#: ElasticFlow's slot on the live cluster: batches last minutes, not the hours of training
#: jobs its 240 s slot was made for.
SLOT_S = 30.0


def need_s(requests: int, most: int, concurrency: int, rate: float) -> float:
    """Seconds ``requests`` take, run ``concurrency`` at once, each making up to ``most``
    units, at ``rate`` units/s over all of them: in waves, each as long as its longest
    request (a batch of 2 takes one request's time however fast the devices are in bulk)."""
    if requests <= 0:
        return 0.0
    return math.ceil(requests / concurrency) * max(most, 1) * concurrency / rate


@dataclass(frozen=True, slots=True)
class Batch:
    job_id: str
    #: Requests not answered yet, and the most units (tokens) one of them may make.
    requests: int
    most: int
    deadline_s: float
    arrived_s: float
    #: Its model's units/s by requests at once, as measured.
    rates: Mapping[int, float]

    def curve(self, streams: int) -> dict[int, float]:
        """The measured points it may use: at most ``streams`` at once, and never more than
        it has requests. With only more at once measured than it has requests left, its
        requests at once run each at the pace one of the fewest measured runs at (a wave as
        long as one request)."""
        usable = {k: r for k, r in self.rates.items() if 0 < k <= streams and r > 0}
        most = max(self.requests, 1)
        within = {k: r for k, r in usable.items() if k <= most}
        if within or not usable:
            return within
        fewest = min(usable)
        return {most: usable[fewest] * most / fewest}

    def seconds(self, streams: int) -> float:
        """Seconds it needs at the largest measured count of requests at once it may use
        (inf where nothing is measured)."""
        curve = self.curve(streams)
        if not curve:
            return math.inf if self.requests > 0 else 0.0
        k = max(curve)
        return need_s(self.requests, self.most, k, curve[k])


def order(policy: str) -> Callable[[Batch], tuple[float, str]]:
    """The policy's order of batches: first come first with ``fifo``, else earliest
    deadline first."""
    if policy == "fifo":
        return lambda b: (b.arrived_s, b.job_id)
    return lambda b: (b.deadline_s, b.job_id)


def _plan_job(batch: Batch, streams: int) -> PlanJob:
    return PlanJob(
        batch.job_id,
        float(batch.requests * max(batch.most, 1)),
        batch.deadline_s,
        batch.curve(streams),
    )


def admit_batch(
    policy: str, admitted: Sequence[Batch], new: Batch, now: float, streams: int
) -> Admission:
    """Whether ``new`` may join ``admitted`` with every deadline still met, under ``policy``
    (see the module); ``now``: when the runner's streams are first free."""
    if not new.curve(streams):
        return Admission(False, math.inf, "no throughput measured for its model")
    if policy in ELASTIC:
        return _admit_elastic(admitted, new, now, streams)
    key = order(policy)

    def work(b: Batch) -> Work:
        return Work(b.job_id, b.seconds(streams), b.deadline_s)

    rank = {b.job_id: key(b) for b in [*admitted, new]}
    return admit([work(b) for b in admitted], work(new), now, lambda w: rank[w.job_id])


def _admit_elastic(admitted: Sequence[Batch], new: Batch, now: float, streams: int) -> Admission:
    jobs = [_plan_job(b, streams) for b in admitted]
    plans, _ = plan_all([*jobs, _plan_job(new, streams)], streams, now, SLOT_S)
    before, _ = plan_all(jobs, streams, now, SLOT_S)
    planned = plans[new.job_id].end_s
    # Those it would push past their deadlines (one late already is not its doing).
    missing = [
        j.job_id
        for j in jobs
        if before[j.job_id].meets_deadline and not plans[j.job_id].meets_deadline
    ]
    if not plans[new.job_id].meets_deadline:
        alone = new.seconds(streams)
        return Admission(
            False,
            planned,
            f"needs about {span(alone)} of serving at all {streams} streams and its deadline "
            f"is in {span(max(0.0, new.deadline_s - now))}: no share of the streams left by "
            "the batches admitted before it ends it in time",
        )
    if missing:
        return Admission(
            False, planned, f"admitting it would make {missing[0]}, admitted before it, miss "
            "its deadline",
        )  # fmt: skip
    return Admission(True, planned, f"planned to end in {span(planned - now)}")


def shares(policy: str, batches: Sequence[Batch], now: float, streams: int) -> dict[str, int]:
    """How many requests at once each batch may have now, under ``policy``."""
    if policy not in ELASTIC:
        out, free = {}, streams
        for batch in sorted(batches, key=order(policy)):
            out[batch.job_id] = min(free, batch.requests)
            free -= out[batch.job_id]
        return out
    jobs = [_plan_job(b, streams) for b in batches if b.curve(streams)]
    plans, _ = plan_all(jobs, streams, now, SLOT_S)
    held, free = {}, streams
    for job in sorted(jobs, key=lambda j: (j.deadline_s, j.job_id)):
        held[job.job_id] = min(plans[job.job_id].gpus_now, free)
        free -= held[job.job_id]
    out = share_leftover(jobs, held, free)
    free = streams - sum(out.values())
    for batch in batches:  # no curve (its model's rates lost): a stream where one is left
        if batch.job_id not in out and free > 0 and batch.requests > 0:
            out[batch.job_id], free = 1, free - 1
    return {b.job_id: out.get(b.job_id, 0) for b in batches}


@dataclass(frozen=True, slots=True)
class Lane:
    """An edge server of ``edgeflow``: a deployment of the batch's model beside the cloud's,
    and its measured units/s by requests at once."""

    deployment_id: str
    rates: Mapping[int, float]


def edge_lane(
    new: Batch, lanes: Sequence[Lane], now: float, streams: int
) -> tuple[str, Admission] | None:
    """EdgeFlow's edge for a batch the cloud declined: the idle ``lanes`` on which it ends by
    its deadline from ``now`` at ``streams`` at once, the slowest of them (``edge_admission``,
    the simulator's code). None when no lane can; else the lane and the admission."""
    servers, ends = [], {}
    for lane in lanes:
        seconds = dataclasses.replace(new, rates=lane.rates).seconds(streams)
        if math.isfinite(seconds) and seconds > 0:
            # As the simulator sees an edge server: speed in units/s, the job's work in units.
            servers.append(EdgeServer(lane.deployment_id, 0.0, 1.0 / seconds))
            ends[lane.deployment_id] = now + seconds
    job = EdgeCandidate(new.job_id, 1.0, new.deadline_s, 1.0, 0.0)
    taken = edge_admission([job], servers, now).get(new.job_id)
    if taken is None:
        return None
    reason = f"on the edge, deployment {taken}: planned to end in {span(ends[taken] - now)}"
    return taken, Admission(True, ends[taken], reason)


def rescued(
    cloud: Sequence[Batch], lanes: Mapping[str, Sequence[Lane]], now: float, streams: int
) -> dict[str, str]:
    """EdgeFlow's rules 2 and 3 made safe: the ``cloud`` batches ElasticFlow's plan of them
    now ends after their deadlines, least able first (the seed's priority: deadline − planned
    end), each onto an idle lane of its own (``lanes``: by batch id, its model's) on which it
    ends by its deadline from ``now`` (``edge_lane``), each lane taken once. Batch id → lane;
    a batch the plan ends in time stays."""
    jobs = [_plan_job(b, streams) for b in cloud if b.curve(streams)]
    plans, _ = plan_all(jobs, streams, now, SLOT_S)
    late = [b for b in cloud if b.job_id in plans and not plans[b.job_id].meets_deadline]
    late.sort(key=lambda b: (b.deadline_s - plans[b.job_id].end_s, b.job_id))
    out: dict[str, str] = {}
    for batch in late:
        free = [ln for ln in lanes.get(batch.job_id, ()) if ln.deployment_id not in out.values()]
        taken = edge_lane(batch, free, now, streams)
        if taken is not None:
            out[batch.job_id] = taken[0]
    return out
