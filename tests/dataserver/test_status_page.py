"""The status page at ``/`` rendered by a real headless Chromium against a running cluster (a data
server, two daemons, a job with committed steps, a node lost), and the API docs served without a CDN."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from ffplane_harness.local_cluster import LocalCluster
from tests._servers import TOKEN, until
from trainer_client import Checkpointer
from trainer_client.jobs import Jobs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, *flags: str) -> str:
    """``url`` rendered by headless Chromium once its script has polled (the DOM, or '' for a screenshot)."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--virtual-time-budget=6000", *flags, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def cluster_with_history(tmp_path: Path, data_dir: Path):  # type: ignore[no-untyped-def]
    with LocalCluster(tmp_path, data_dir, TOKEN) as c:
        ds = c.start_dataserver()
        for _ in range(2):
            c.start_daemon("--gate-chunk-kb", "64", budget_mb=64)
        until(lambda: len(httpx.get(ds.url + "/v1/nodes").json()["ring"]) == 2, what="two daemons in the ring")
        Jobs(ds.url, TOKEN).create("page", dataset="tokens", dp=1, batch_per_rank=4, max_steps=10)
        ck = Checkpointer("page", socket_path=c.socket(0))
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1 << 14,), float(step))})
        ck.settle()  # step 3 has a replica on n1
        ck.close()
        c.lose_node(1)
        until(lambda: not httpx.get(ds.url + "/v1/cluster").json()["members"]["n1"]["alive"], what="n1 declared dead")
        yield c


def test_docs_are_served_from_local_assets(cluster_with_history: LocalCluster) -> None:
    ds = cluster_with_history.dataserver
    assert ds is not None
    for page, asset in (("/docs", "/static/docs/swagger-ui-bundle.js"), ("/redoc", "/static/docs/redoc.standalone.js")):
        html = httpx.get(ds.url + page).text
        assert asset in html and "cdn" not in html.lower() and "fonts.googleapis" not in html
        assert httpx.get(ds.url + asset).status_code == 200
    daemon = cluster_with_history.daemons[0]
    assert "/static/docs/swagger-ui-bundle.js" in httpx.get(daemon.url + "/docs").text


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_status_page_shows_the_cluster_in_a_browser(cluster_with_history: LocalCluster, tmp_path: Path) -> None:
    ds = cluster_with_history.dataserver
    assert ds is not None
    dom = chromium(ds.url + "/", "--dump-dom")
    assert "loading" not in dom.split('id="meta"')[1][:200]  # the script ran and drew the answer
    assert '<td>n0</td><td><span class="alive">alive</span>' in dom
    assert '<td>n1</td><td><span class="dead">dead</span>' in dom
    assert "page/dp0-pp0-tp0 @3" in dom  # n0's role and its newest committed step
    assert 'data-job="page">3</b>' in dom  # the job's restorable step
    assert "<td>node lost</td><td>n1</td>" in dom  # the failure, in the recent failures table
    assert "x its shards" in dom and "4.00x the shard" in dom  # what checkpoints take, per node and per role
    assert "one node loss; at most 1 lost step" in dom
    shot = tmp_path / "status.png"
    chromium(ds.url + "/", f"--screenshot={shot}", "--window-size=1280,760", "--hide-scrollbars")
    assert shot.stat().st_size > 10_000


def test_ffplane_status_shows_what_checkpoints_take_per_node_and_per_role(cluster_with_history: LocalCluster) -> None:
    from ffplane_harness.cli import render_status

    ds = cluster_with_history.dataserver
    assert ds is not None
    lines = render_status(httpx.get(ds.url + "/v1/cluster").json()).splitlines()
    assert "CHECKPOINTS" in lines[1]
    (n0,) = [line for line in lines if line.startswith("n0 ")]
    assert "MiB = 2.00x" in n0  # its one role's two slots; n1's replicas went with n1
    (role,) = [line for line in lines if line.startswith("dp0-pp0-tp0 ")]
    assert "4.00x" in role and "one node loss; at most 1 lost step" in role  # a role alone: its saves are settled


def test_recovery_is_the_first_newer_commit_after_the_failure() -> None:
    from dataserver.cluster_view import _recovery

    commits = [(10.0, 5), (11.0, 6), (14.5, 6), (15.0, 7), (16.0, 8)]  # step 6 committed again after a rewind
    assert _recovery(commits, 12.0) == 3.0  # newest by then: 6; the first newer one: 7 at 15.0
    assert _recovery(commits, 16.5) is None  # nothing newer yet
    assert _recovery(commits, 9.0) is None  # nothing kept from before: cannot tell


NODE = shutil.which("node") or shutil.which("nodejs")


def run_page_script(answer: str, element: str) -> str:
    """The page's own script run by Node against ``answer`` (a JS expression for what ``fetch``
    resolves to): the HTML it writes into ``element`` (an id, or a selector the script uses)."""
    import re

    from dataserver.status_page import STATUS_PAGE

    script = re.search(r"<script>(.*)</script>", STATUS_PAGE, re.S)
    assert script is not None and NODE is not None
    harness = f"""
const els = {{}};
const el = (id) => (els[id] = els[id] || {{ innerHTML: "", textContent: "" }});
globalThis.document = {{ getElementById: el, querySelector: el }};
globalThis.setTimeout = () => {{}};
globalThis.fetch = async () => ({answer});
{script.group(1)}
setImmediate(() => process.stdout.write(els[{element!r}].innerHTML));
"""
    done = subprocess.run([NODE, "-e", harness], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _page_script_with(leader: str) -> str:
    """What the page says to a follower's answer (421, ``leader`` in the header)."""
    import json

    return run_page_script(f"{{ status: 421, ok: false, headers: {{ get: () => {json.dumps(leader)} }} }}", "error")


@pytest.mark.skipif(NODE is None, reason="no Node.js to run the page's script")
def test_a_followers_page_links_only_to_an_http_leader() -> None:
    html = _page_script_with("javascript:alert(1)")
    assert "<a" not in html and "href" not in html and "javascript:alert(1)" in html  # shown, not linked
    html = _page_script_with('http://10.0.0.1:8470"><script>x</script>')
    assert "<script>" not in html
    html = _page_script_with("http://10.0.0.1:8470")
    assert '<a href="http://10.0.0.1:8470/">http://10.0.0.1:8470</a>' in html
