"""The dashboard in headless Chromium (Debian's ``chromium``, driven by Playwright; no browser download)
against a real controller and a CPU worker running a real job.

The page is opened while the job runs and watched until it has finished: it lists the job, every progress it
ever shows stays within 100% (and done within total), each slot's history chart has one point per finished
trial at the overlap time the API holds for it, the comparison bars are the winner's and the baselines'
numbers, the preset it downloads is byte for byte what ``GET /v1/presets`` serves, cancel needs the token,
and a GPU worker is listed with its GPUs.
``AUTOTUNE_DASHBOARD_SCREENSHOT=docs/dashboard.png`` also saves the README's screenshot.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

if TYPE_CHECKING:
    from conftest_service import Service

pytestmark = pytest.mark.slow
pytest_plugins = ("conftest_service",)  # make_service, sqlite_url

CHROMIUM = Path("/usr/bin/chromium")
SHAPE = {"hidden": 64, "tp": 2, "seq": 32}
SLOTS = ["qkv_fprop", "proj_fprop"]
TIMEOUT_MS = 120_000
SCREENSHOT_MAX_BYTES = 300_000

# Installed before the page's own script: records every progress the page ever renders, wherever it is.
RECORD_PROGRESS = """
window.progressSeen = [];
new MutationObserver(() => {
  for (const p of document.querySelectorAll(".progress")) {
    window.progressSeen.push({fraction: +p.dataset.fraction, done: +p.dataset.done, total: +p.dataset.total,
                              text: p.textContent});
  }
}).observe(document, {subtree: true, childList: true});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("needs Debian's chromium: apt-get install -y chromium (`make test` installs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


def fastest_ms(trial: dict[str, Any]) -> float | None:
    """What the history chart plots for a trial: its fastest valid measurement, None (a gap) when it failed."""
    times = [m["overlap_ms"] for m in (trial["measurement"] or {}).get("measurements", []) if m["valid"]]
    return min(times) if trial["state"] == "complete" and times else None


def preset_query(job: dict[str, Any]) -> dict[str, str]:
    query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in job["shape"].items() if v is not None}
    return query | {"gpu": "cpu", "consumer": job["consumer"]}


def download(page: Page, tab: str) -> str:
    page.click(f"#preset-tabs [data-format={tab}]")
    with page.expect_download() as got:
        page.click("#download-preset")
    return Path(got.value.path()).read_text()


def test_the_dashboard_follows_a_cpu_job_to_its_charts_and_preset(
    make_service, sqlite_url: str, browser: Browser
) -> None:
    service: Service = make_service(db_url=sqlite_url)
    service.start_controller()
    service.start_worker()
    auth = {"Authorization": f"Bearer {service.token}"}
    body = {"shape": SHAPE, "layers": SLOTS, "n_trials": 6, "backend": "cpu", "consumer": "megatron"}
    job_id = httpx.post(f"{service.url}/v1/jobs", json=body, headers=auth).json()["id"]

    page = browser.new_page(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    missing: list[str] = []  # the favicon among them, which browsers ask for unasked
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    page.add_init_script(RECORD_PROGRESS)
    page.goto(service.url)
    page.click(f"tr[data-job='{job_id}']", timeout=TIMEOUT_MS)  # the page lists the job
    page.wait_for_function(
        "() => window.dashboard.jobShown?.status === 'succeeded' && window.dashboard.presets.te",
        timeout=TIMEOUT_MS,
    )
    job = httpx.get(f"{service.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded"

    # Progress: never past 100% nor done past total, whatever the page showed on the way; 100% at the end.
    seen = page.evaluate("window.progressSeen")
    assert seen, "the page showed no progress"
    assert all(p["fraction"] <= 1 and p["done"] <= p["total"] for p in seen), seen
    assert all(int(p["text"].split("%")[0]) <= 100 for p in seen), seen
    head = page.locator("#job-head .progress")
    assert head.inner_text().strip() == f"100% · {job['progress']['done']}/{job['progress']['done']} trials"

    # Charts: one point per finished trial of the slot, at the time the API holds; bars from the winner.
    trials = httpx.get(f"{service.url}/v1/jobs/{job_id}/trials", params={"limit": 1000}).json()["items"]
    (group,) = httpx.get(f"{service.url}/v1/best", params=preset_query(job)).json()["results"]
    outcomes = {layer["slot"]: layer["outcome"] for layer in group["layers"]}
    charts = page.evaluate(
        "Object.fromEntries(Object.entries(window.dashboard.charts).map(([slot, c]) => [slot, {"
        "history: c.history.data, exposed: c.exposed.data[1], hidden: c.hidden?.data[1] ?? null, names: c.exposed.names}]))"
    )
    assert set(charts) == set(SLOTS)
    for slot in job["slots"]:
        finished = [t for t in trials if t["slot"] == slot["slot"] and t["state"] in ("complete", "failed")]
        xs, ys, best = charts[slot["slot"]]["history"]
        assert len(xs) == len(ys) == len(finished) > 0
        assert ys == pytest.approx([fastest_ms(t) for t in finished])
        assert best[-1] == pytest.approx(min(y for y in ys if y is not None))
        won = slot["best"]["measurement"]
        names = charts[slot["slot"]]["names"]
        assert names[:2] == ["winner", "serial"]
        assert charts[slot["slot"]]["exposed"][:2] == pytest.approx(
            [won["overlap_ms"] - won["gemm_ms"], won["serial_ms"] - won["gemm_ms"]]
        )
        # The CPU backend's share hidden means nothing: n/a with the reason, in the head and in place of its chart.
        assert charts[slot["slot"]]["hidden"] is None
        card = page.locator(f"[data-slot={slot['slot']}]")
        assert "hidden n/a (CPU backend)" in card.locator(".slot-head").inner_text()
        assert (
            card.locator("[data-chart=hidden]")
            .inner_text()
            .endswith(
                "n/a: measured on the CPU backend (gloo between CPU processes), whose times show that the service works, "
                "not what a GPU gains; tune on GPUs for numbers to use"
            )
        )
        # TE's default as the decision re-measured it beside the finalists, else as its search trial did.
        te = outcomes[slot["slot"]]["te_default_measurement"]
        if te is None:
            trial = next(t for t in trials if t["slot"] == slot["slot"] and "te_default" in t["config"]["labels"])
            te = trial["measurement"]["measurements"][0]
        assert charts[slot["slot"]]["exposed"][names.index("TE default")] == pytest.approx(
            te["overlap_ms"] - te["gemm_ms"]
        )
        assert page.locator(f"[data-slot={slot['slot']}] [data-chart=history]").get_attribute("data-points") == str(
            len(finished)
        )

    # The preset: the downloaded files are what GET /v1/presets serves.
    query = preset_query(job)
    yaml_text = httpx.get(f"{service.url}/v1/presets", params=query).text
    assert download(page, "nemo") == yaml_text
    assert page.locator("#preset").inner_text().strip() == yaml_text.strip()
    # Its long comment lines wrap inside the panel rather than run off it.
    assert max(map(len, yaml_text.splitlines())) > 100
    assert page.evaluate("(p => p.scrollWidth <= p.clientWidth)(document.getElementById('preset'))")
    te_text = httpx.get(f"{service.url}/v1/presets", params=query | {"format": "te"}).text
    assert download(page, "te") == te_text
    # The Bridge module where the controller serves one: a tab of its own, downloaded as served.
    bridge = httpx.get(f"{service.url}/v1/presets", params=query | {"format": "bridge"})
    assert page.locator("#preset-tabs [data-format=bridge]").count() == (bridge.status_code == 200)
    if bridge.status_code == 200:
        assert download(page, "bridge") == bridge.text

    # The job's consumer: the joint winner's switches and the settings compared, the chosen one first.
    choice = job["consumer_choice"]
    assert choice["consumer"] == "megatron" and choice["switches"]["flags"][0] == "--tp-comm-overlap"
    assert page.locator("#consumer code").inner_text() == " ".join(choice["switches"]["flags"]) + (
        " · TransformerConfig: " + ", ".join(f"{k}={str(v).lower()}" for k, v in choice["switches"]["config"].items())
        if choice["switches"]["config"]
        else ""
    )
    rows = page.locator("#consumer table.alternatives tbody tr")
    assert rows.count() == min(4, len(choice["alternatives"]))
    assert rows.first.locator("td").first.inner_text() == choice["alternatives"][0]["label"]

    # Workers with their GPUs (none on the CPU backend).
    assert page.locator("#workers tr").count() == 1

    shot = os.environ.get("AUTOTUNE_DASHBOARD_SCREENSHOT")
    if shot:
        page.click("#preset-tabs [data-format=nemo]")
        page.screenshot(path=shot, full_page=True)
        assert Path(shot).stat().st_size < SCREENSHOT_MAX_BYTES
    # A worker stopped cleanly (SIGTERM, as Ctrl-C) is shown stopped, in grey: not lost, not red.
    service.workers[0].stop()
    assert httpx.get(f"{service.url}/v1/workers").json()[0]["status"] == "stopped"
    stopped = "document.querySelector('#workers td.stopped')"
    page.wait_for_function(f"() => {stopped}?.textContent === 'stopped'", timeout=TIMEOUT_MS)
    assert page.evaluate(f"getComputedStyle({stopped}).color") == "rgb(136, 136, 136)"
    assert not errors, errors
    assert not missing, missing
    favicon = httpx.get(f"{service.url}/favicon.ico")
    assert favicon.status_code == 200 and favicon.headers["content-type"].startswith("image/svg+xml")


def test_cancel_from_the_dashboard_needs_the_token(make_service, sqlite_url: str, browser: Browser) -> None:
    """A job no worker can run (cuda, none here) stays queued until cancelled, and only with the token; a GPU
    worker's inventory is listed GPU by GPU."""
    service: Service = make_service(db_url=sqlite_url)
    service.start_controller()
    auth = {"Authorization": f"Bearer {service.token}"}
    job_id = httpx.post(f"{service.url}/v1/jobs", json={"shape": SHAPE, "backend": "cuda"}, headers=auth).json()["id"]
    gpus = [
        {"index": i, "name": "NVIDIA H200", "memory_total_mib": 143771, "sm_count": 132, "nvlink_active": 18}
        for i in range(2)
    ]
    worker = {
        "name": "gpu-node",
        "host": "node1",
        "backend": "cuda",
        "gpus": gpus,
        "gpu_model": "NVIDIA H200",
        "n_gpus": 2,
    }
    assert httpx.post(f"{service.url}/v1/workers", json=worker, headers=auth).status_code == 201
    page = browser.new_page()
    page.goto(service.url)
    row = page.locator("#workers tr", has_text="gpu-node")
    row.wait_for()
    assert "0: NVIDIA H200 140 GiB 132 SMs NVLink×18, 1: NVIDIA H200 140 GiB 132 SMs NVLink×18" in row.inner_text()
    cancel = f"tr[data-job='{job_id}'] button.cancel"
    page.click(cancel, timeout=TIMEOUT_MS)
    page.wait_for_function("() => document.getElementById('message').textContent.includes('401')")
    assert httpx.get(f"{service.url}/v1/jobs/{job_id}").json()["status"] in ("queued", "running")
    page.fill("#token", service.token)
    page.click(cancel)
    service.wait_until(
        lambda: httpx.get(f"{service.url}/v1/jobs/{job_id}").json()["status"] == "cancelled",
        timeout_s=30,
        what="the job to be cancelled",
    )
    assert page.locator("#message").inner_text() == ""
