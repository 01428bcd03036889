"""The dashboard in a real browser (Debian's Chromium, headless, driven by Selenium through
Debian's chromedriver) against `tessera up` with an API key: the login hides every datum, the
fleet lists what the scorer knows, the mode control changes the cluster's mode, the chat box
streams an answer, and a killed worker turns failed with a migration in the feed, all without
a reload. Screenshots are kept in ``test-artifacts/``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from libs.models.shipped import MODEL_NAME
from tests.e2e.cluster import RunningCluster, process_with_env

KEY = "dashboard-key"
ARTIFACTS = Path(
    os.environ.get("TESSERA_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")
)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    running = RunningCluster(
        "--workers",
        "2",
        *("--restart", "no"),  # the killed worker stays failed, as the page is to show
        devices=2,
        env={
            "TESSERA_GATEWAY_API_KEYS": f'["{KEY}"]',
            "TESSERA_TELEMETRY_INTERVAL_S": "1",
            "TESSERA_WORKER_INTERVAL_S": "1",
        },
    )
    running.wait_for("ready:", 240)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are needed (make deps)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1440,1200")
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


def api(cluster: RunningCluster, path: str) -> Any:
    headers = {"authorization": f"Bearer {KEY}"}
    response = httpx.get(f"{cluster.base_url}{path}", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()


def shown_devices(browser: WebDriver) -> dict[str, str]:
    """device id → state, as the page shows them now."""
    rows = browser.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
    return {r.get_attribute("data-device") or "": r.get_attribute("data-state") or "" for r in rows}


async def weights_moving(
    cluster: RunningCluster, deployment: dict[str, Any], device: str, done: int, total: int
) -> None:
    """Publish a device's weights progress on the cluster's NATS, as its worker does while it
    fetches (through the run file's admin connection: the test holds no device's password)."""
    from libs.cluster import runfile
    from libs.contracts import WEIGHTS_PROGRESS, WeightsProgress
    from libs.runtime.bus import NatsBus
    from libs.runtime.nats_client import close_nats, connect_nats

    running = runfile.read(cluster.run_file)
    ca = running.get("nats_ca")
    nc = await connect_nats(running["nats_url"], "test-weights", ca_file=Path(ca) if ca else None)
    message = WeightsProgress(
        device_id=device,
        model=deployment["model"],
        deployment_id=deployment["deployment_id"],
        shard_index=0,
        bytes_done=done,
        bytes_total=total,
        ts=time.time(),
    )
    await NatsBus(nc).publish(WEIGHTS_PROGRESS, message, device_id=device)
    await close_nats(nc)


def submit_batch(cluster: RunningCluster, count: int) -> str:
    """A batch of ``count`` short chat requests, through the Batch API; its id."""
    headers = {"authorization": f"Bearer {KEY}"}
    lines = [
        {"custom_id": f"d-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4}}
        for i in range(count)
    ]  # fmt: skip
    content = "".join(json.dumps(line) + "\n" for line in lines)
    with httpx.Client(base_url=cluster.base_url, headers=headers, timeout=60) as http:
        file = http.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", content)}
        )
        file.raise_for_status()
        body = {"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "1h"}  # fmt: skip
        batch = http.post("/v1/batches", json=body)
        batch.raise_for_status()
        return str(batch.json()["id"])


def until(browser: WebDriver, condition: Any, timeout_s: float = 60) -> Any:
    """``condition()``'s first true answer; an element the page redrew between finding it and
    reading it (stale: the dashboard re-renders as events arrive) counts as not yet."""
    wait = WebDriverWait(
        browser, timeout_s, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    )
    return wait.until(lambda _: condition())


def test_the_dashboard_shows_the_cluster_live_and_controls_it(
    cluster: RunningCluster, browser: WebDriver
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.get(f"{cluster.base_url}/")
    # Without a key: the login, and no data at all.
    until(browser, lambda: browser.find_element(By.ID, "login").is_displayed())
    assert not browser.find_element(By.ID, "app").is_displayed()
    assert shown_devices(browser) == {}
    browser.save_screenshot(str(ARTIFACTS / "dashboard-login.png"))

    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#login-form button").click()
    # The fleet: every device the scorer knows (the emulated ones and both workers).
    until(browser, lambda: len(api(cluster, "/v1/cluster/devices")) == 4)
    known = {row["device_id"] for row in api(cluster, "/v1/cluster/devices")}
    until(browser, lambda: set(shown_devices(browser)) == known)
    # Where readings come from: a worker's power is its class's figure, its speed this host's
    # scaled by its class; an emulated device's all its class's.
    row = '#fleet tbody tr[data-device="worker-0"]'
    marks = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, f"{row} small.source"))
    assert {m.text for m in marks} == {"emulated", "estimated"}, [m.text for m in marks]
    until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#deployments .shard"))
    # Each deployment with its phase: the model's workers loaded it, so it serves.
    phase = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#deployments .phase"))
    assert [p.text for p in phase] == ["serving"]
    # Weights on their way to a device: its bar, drawn from the event feed as bytes arrive.
    [deployment] = api(cluster, "/v1/cluster/placements")
    device = deployment["assignments"][0]["device_id"]
    asyncio.run(weights_moving(cluster, deployment, device, 40_000_000, 100_000_000))
    row = until(
        browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#deployments .weights-row")
    )
    assert row[0].text == f"{device}: 40.0 / 100.0 MB of weights"
    bar = row[0].find_element(By.TAG_NAME, "progress")
    assert bar.get_attribute("value") == "40000000" and bar.get_attribute("max") == "100000000"

    # The mode control changes the cluster's mode.
    until(browser, lambda: browser.find_element(By.ID, "mode").is_enabled())
    Select(browser.find_element(By.ID, "mode")).select_by_value("energy")
    until(browser, lambda: api(cluster, "/v1/cluster/mode") == {"mode": "energy", "manual": True})

    # Previews: every candidate placement, per device.
    browser.find_element(By.ID, "preview-go").click()
    until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#previews .preview li"))
    first = browser.find_element(By.CSS_SELECTOR, "#previews .preview h4").text
    assert "predicted" in first and "tokens/s at 1 stream" in first, first  # llama.cpp workers
    assert re.search(r"first token in \d+ ms, \d+ W", first), first

    # A chat message streams an answer.
    browser.find_element(By.ID, "chat-input").send_keys(
        "Name three colours of the rainbow and say why."
    )
    browser.find_element(By.ID, "chat-send").click()
    answer = until(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, "#chat-log .assistant[data-done]"),
        120,
    )[0]
    assert answer.get_attribute("data-done") == "true" and answer.text.strip()

    # The deployment's speed: predicted when it was placed, beside what that answer measured.
    def measured() -> list[str]:
        lines = browser.find_elements(By.CSS_SELECTOR, "#deployments .speed")
        return [e.text for e in lines if re.search(r"measured \d+\.\d tokens/s", e.text)]

    [speed] = until(browser, measured, 30)
    assert re.search(r"predicted \d+\.\d tokens/s at 1 stream", speed), speed

    # A batch submitted through the Batch API: its row, with its progress, until it ends.
    batch = submit_batch(cluster, 3)
    row = f'#jobs tr[data-batch="{batch}"][data-status="completed"]'
    [shown] = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, row), 120)
    assert "3/3" in shown.text and MODEL_NAME in shown.text
    assert shown.find_element(By.TAG_NAME, "progress").get_attribute("value") == "3"
    [deployment] = api(cluster, "/v1/cluster/placements")
    serving = {a["device_id"] for a in deployment["assignments"]}
    devices = shown.find_elements(By.TAG_NAME, "td")[-1].text  # those that answered
    assert devices != "–" and set(devices.split(", ")) <= serving, (devices, serving)

    # Kill the worker that serves the model: its row turns failed and the feed shows the
    # migration, pushed to the open page.
    host = deployment["assignments"][0]["device_id"]
    pid = process_with_env(cluster.process.pid, "TESSERA_WORKER_DEVICE_ID", host)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    until(browser, lambda: shown_devices(browser).get(host) == "failed", 60)
    failed_after = time.monotonic() - killed
    until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#events li.migration"), 60)
    moved_after = time.monotonic() - killed
    print(f"dashboard: {host} failed after {failed_after:.2f} s, migration {moved_after:.2f} s")
    feed = browser.find_element(By.ID, "events").text
    assert f"{host} failed" in feed and "migration" in feed
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    # Signed out (a page with no key): the login again, and the data gone from the page.
    browser.find_element(By.ID, "logout").click()
    until(browser, lambda: browser.find_element(By.ID, "login").is_displayed())
    assert shown_devices(browser) == {}
