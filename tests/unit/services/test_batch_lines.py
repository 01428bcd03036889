"""A batch's input file, checked whole before anything is queued: each fault named by its line."""

from __future__ import annotations

import json

import pytest

from services.gateway.batches.lines import LineError, read_lines, window_seconds

CHAT = "/v1/chat/completions"


def line(custom_id: str, **body: object) -> str:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": request})


def test_every_request_is_read_in_order_with_its_token_budget() -> None:
    content = "\n".join([line("a", max_tokens=8), "", line("b")]).encode()
    lines = read_lines(content, CHAT)
    assert [(x.number, x.custom_id, x.token_budget) for x in lines] == [(1, "a", 8), (3, "b", 256)]


@pytest.mark.parametrize(
    ("lines", "where", "cause"),
    [
        (["{not json"], 1, "not JSON"),
        ([line("a"), line("a")], 2, "custom_id 'a' is also on line 1"),
        ([line("a"), line("b", stream=True)], 2, "stream"),
        ([line("a", max_tokens=0)], 1, "body.max_tokens"),
        ([line("a", temperature="hot")], 1, "body.temperature"),
        ([line("a", unknown_field=1)], 1, "unknown_field"),
        ([line("a"), line("b").replace('"model": "m"', '"model": "other"')], 2, "'other'"),
        ([line("a").replace(CHAT, "/v1/embeddings")], 1, "this batch's endpoint"),
        (['["a list"]'], 1, "not a JSON object"),
        ([json.dumps({"custom_id": "", "url": CHAT, "body": {}})], 1, "custom_id"),
    ],
)
def test_a_fault_is_refused_with_its_line_number_and_cause(
    lines: list[str], where: int, cause: str
) -> None:
    with pytest.raises(LineError) as refused:
        read_lines("\n".join(lines).encode(), CHAT)
    assert refused.value.line == where
    assert str(refused.value).startswith(f"line {where}: ") and cause in str(refused.value)


def test_a_request_over_the_gateways_body_limit_is_refused_by_its_line() -> None:
    long = line("b", messages=[{"role": "user", "content": "x" * 5000}])
    with pytest.raises(LineError, match=r"line 2: body of 5\d+ bytes: a request may be 4096"):
        read_lines(f"{line('a')}\n{long}".encode(), CHAT, max_body_bytes=4096)


def test_a_file_that_is_not_text_or_holds_nothing_is_refused() -> None:
    with pytest.raises(LineError, match="not UTF-8"):
        read_lines(b"\xff\xfe", CHAT)
    with pytest.raises(LineError, match="no request"):
        read_lines(b"\n\n", CHAT)


def test_a_completion_window_is_any_span_and_nothing_else() -> None:
    assert window_seconds("24h") == 86_400 and window_seconds("30m") == 1800
    assert window_seconds("90s") == 90 and window_seconds("1.5h") == 5400
    for bad in ("", "soon", "-2h", "0m", "2 weeks"):
        with pytest.raises(ValueError, match="completion_window"):
            window_seconds(bad)


TRAIN = "/v1/tessera/train"


def run(custom_id: str, **body: object) -> str:
    request = {"model": "tessera-mlp", "steps": 100, **body}
    return json.dumps({"custom_id": custom_id, "url": TRAIN, "body": request})


def test_a_training_jobs_lines_are_runs_counted_by_their_steps() -> None:
    from libs.cli.job_commands import training_runs

    lines = read_lines(training_runs(3, 500, 50), TRAIN)
    assert [(x.custom_id, x.token_budget) for x in lines] == [
        ("run-0", 500), ("run-1", 500), ("run-2", 500)
    ]  # fmt: skip
    assert [x.body["seed"] for x in lines] == [0, 1, 2]


@pytest.mark.parametrize(
    ("bad", "cause"),
    [
        (run("a", steps=0), "body.steps"),
        (run("a", every=0), "body.every"),
        (run("a", model="smollm2-135m-instruct"), "body.model"),
        (run("a", run="../../etc/passwd"), "body.run"),  # the runner names the checkpoint
        (run("a").replace(TRAIN, CHAT), "this batch's endpoint"),
    ],
)
def test_a_bad_training_run_is_refused_with_its_line(bad: str, cause: str) -> None:
    with pytest.raises(LineError) as caught:
        read_lines(f"{run('ok')}\n{bad}\n".encode(), TRAIN)
    assert caught.value.line == 2 and cause in caught.value.cause


def test_the_trained_model_is_the_one_the_contract_names() -> None:
    from libs.contracts.batch_requests import TRAIN_MODEL
    from services.gateway.batches.lines import TrainRequest

    assert TrainRequest(model=TRAIN_MODEL, steps=1).model == TRAIN_MODEL  # type: ignore[arg-type]
