"""What the gateway measures of each deployment (``services/gateway/core/speeds.py``): the
tokens/s of requests that ran alone and of eight at once, the time to a first token, each plan
(epoch) on its own, sent once per new figures."""

from __future__ import annotations

from libs.contracts import DeploymentMeasured
from services.gateway.core.speeds import Speeds


def run_alone(speeds: Speeds, deployment: str = "d", epoch: int = 1, tokens: int = 21) -> None:
    """A request that starts at 0 s, streams its first token at 0.5 s and its last 2 s later."""
    run = speeds.began(deployment, epoch)
    speeds.ended(run, tokens, 0.5, 2.5, 0.0, epoch)


def test_a_request_alone_gives_the_one_stream_rate_and_the_first_token_time() -> None:
    speeds = Speeds()
    run_alone(speeds)
    figures = speeds.measured("d")
    assert figures is not None
    speed, requests = figures
    assert (speed.tokens_per_s_1, speed.tokens_per_s_8, speed.ttft_ms) == (10.0, None, 500.0)
    assert requests == 1


def test_eight_at_once_give_the_aggregate_and_do_not_count_as_alone() -> None:
    speeds = Speeds()
    runs = [speeds.began("d", 1) for _ in range(8)]
    for run in runs:  # each decodes 4 tokens/s beside the seven others
        speeds.ended(run, 21, 1.0, 6.0, 0.0, 1)
    assert speeds.measured("d") is None  # nothing ran alone yet
    run_alone(speeds)
    figures = speeds.measured("d")
    assert figures is not None
    assert (figures[0].tokens_per_s_1, figures[0].tokens_per_s_8, figures[1]) == (10.0, 32.0, 9)


def test_a_request_that_overlapped_another_counts_beside_it_even_after_it_ended() -> None:
    speeds = Speeds()
    first = speeds.began("d", 1)
    second = speeds.began("d", 1)
    speeds.ended(second, 21, 0.5, 2.5, 0.0, 1)
    speeds.ended(first, 21, 0.5, 2.5, 0.0, 1)
    assert speeds.measured("d") is None  # two at once: neither is a one-stream figure
    run_alone(speeds)  # and the next one alone is
    assert speeds.measured("d") is not None


def test_short_answers_and_requests_that_outlived_their_plan_are_not_counted() -> None:
    speeds = Speeds()
    run_alone(speeds, tokens=3)
    run = speeds.began("d", 1)
    speeds.ended(run, 21, 0.5, 2.5, 0.0, 2)  # the deployment moved while it ran
    assert speeds.measured("d") is None


def test_a_new_plan_is_measured_afresh() -> None:
    speeds = Speeds()
    run_alone(speeds, epoch=1)
    run = speeds.began("d", 2)
    speeds.ended(run, 41, 0.25, 2.25, 0.0, 2)  # 20 tokens/s on the new plan
    figures = speeds.measured("d")
    assert figures is not None and figures[0].tokens_per_s_1 == 20.0 and figures[1] == 1


async def test_each_deployment_is_sent_once_per_new_figures() -> None:
    speeds, sent = Speeds(), []

    async def publish(news: DeploymentMeasured) -> None:
        sent.append(news)

    run_alone(speeds, "a")
    run_alone(speeds, "b", epoch=3)
    await speeds.send(publish)
    assert [(n.deployment_id, n.epoch, n.measured.tokens_per_s_1) for n in sent] == [
        ("a", 1, 10.0),
        ("b", 3, 10.0),
    ]
    await speeds.send(publish)
    assert len(sent) == 2  # nothing new
    run_alone(speeds, "a")
    await speeds.send(publish)
    assert [n.deployment_id for n in sent[2:]] == ["a"]


async def test_a_removed_deployment_is_forgotten_once_its_requests_ended() -> None:
    """The gateway keeps figures only of deployments there are: a removed one's go at the
    next sending (not sent), unless a request of it is still in flight."""
    speeds = Speeds()
    run_alone(speeds, "gone")
    run_alone(speeds, "kept")
    still = speeds.began("leaving", 1)
    sent: list[DeploymentMeasured] = []

    async def publish(news: DeploymentMeasured) -> None:
        sent.append(news)

    await speeds.send(publish, live=["kept"])
    assert [n.deployment_id for n in sent] == ["kept"]
    assert speeds.measured("gone") is None and set(speeds.seen) == {"kept"}
    assert speeds.running["leaving"] == [still]  # in flight: kept until it ends
    speeds.ended(still, 21, 0.5, 2.5, 0.0, 1)
    await speeds.send(publish, live=["kept"])
    assert "leaving" not in speeds.seen and "leaving" not in speeds.running
