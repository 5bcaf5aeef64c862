"""The web console in a real browser: Debian's Chromium driven by Playwright, against
the session's real daemon and real gVisor machines (docs/console.md).

Login goes through ``boxd console --print-url`` as a user's would. Every test fails on
a browser console error or an uncaught page error, and leaves screenshots in its
artifacts folder (tests/_support/artifacts.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from boxd import errors
from tests._support.browser import Shots, chromium

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the dev extra installs playwright")

pytestmark = pytest.mark.vm

WAIT_MS = 30_000


def _login_url(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "boxd", "console", "--print-url"],
                         check=True, capture_output=True, text=True, env=env).stdout
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


@pytest.fixture
def shots(request: pytest.FixtureRequest) -> Shots:
    return Shots(request.node.nodeid)


@pytest.fixture
def page_errors() -> list[str]:
    return []


@pytest.fixture
def open_page(browser: Any, page_errors: list[str], daemon: Any,
              ) -> Iterator[Callable[..., Any]]:
    """Open a page in a new browser context (its own cookies): logged in through
    ``boxd console --print-url`` unless ``login=False``. The test fails on any browser
    console error or page error."""
    contexts: list[Any] = []

    def open_(login: bool = True) -> Any:
        ctx = browser.new_context(viewport={"width": 1400, "height": 900})
        contexts.append(ctx)
        page = ctx.new_page()
        page.on("console", lambda m: page_errors.append(f"console {m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: page_errors.append(f"page error: {e}"))
        page.set_default_timeout(WAIT_MS)
        if login:
            page.goto(_login_url(daemon.env()))
            page.wait_for_url("**/")
        return page

    yield open_
    for ctx in contexts:
        ctx.close()


@pytest.fixture(autouse=True)
def _no_browser_errors(page_errors: list[str]) -> Iterator[None]:
    yield
    assert page_errors == [], "the browser reported errors:\n" + "\n".join(page_errors)


@pytest.fixture
def forks(client: Any, gvisor_base: Any) -> Iterator[Callable[..., Any]]:
    """Fork the module's gVisor base; the forks are deleted after the test."""
    made: list[str] = []

    def fork(name: str | None = None, **labels: str) -> Any:
        m = client.machines.fork(gvisor_base.id, name or f"c-{uuid.uuid4().hex[:6]}",
                                 labels=labels)
        made.append(m.id)
        return m

    yield fork
    for mid in made:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(mid)


def _row(page: Any, machine_id: str) -> Any:
    return page.locator(f'#machines tbody tr[data-id="{machine_id}"]')


def test_the_table_shows_machines_and_updates_live(
        open_page: Callable[..., Any], gvisor_base: Any, forks: Callable[..., Any],
        shots: Shots) -> None:
    page = open_page()
    sync_api.expect(_row(page, gvisor_base.id)).to_be_visible()
    sync_api.expect(page.locator("#live")).to_have_text("live")
    shots(page, "table")
    page.evaluate("window.__sameDocument = true")
    child = forks(f"live-{uuid.uuid4().hex[:6]}", console="live")
    row = _row(page, child.id)
    sync_api.expect(row).to_be_visible()  # the stream brought it: no reload
    assert page.evaluate("window.__sameDocument") is True
    sync_api.expect(row.locator("td").nth(0)).to_have_text(child.name)
    sync_api.expect(row.locator("td").nth(5)).to_have_text(gvisor_base.name)  # parent
    sync_api.expect(row.locator(".label")).to_have_text("console=live")
    shots(page, "created-live")

    page.get_by_label("Label").fill("console=live")
    sync_api.expect(row).to_be_visible()
    sync_api.expect(_row(page, gvisor_base.id)).to_be_hidden()
    page.get_by_label("Label").fill("")
    page.get_by_label("State").select_option("suspended")
    sync_api.expect(_row(page, gvisor_base.id)).to_be_hidden()
    page.get_by_label("State").select_option("running")
    sync_api.expect(_row(page, gvisor_base.id)).to_be_visible()
    shots(page, "filtered")


def test_a_fork_appears_under_its_source_in_the_graph(
        open_page: Callable[..., Any], client: Any, gvisor_base: Any,
        forks: Callable[..., Any], shots: Shots) -> None:
    child = forks()
    grandchild_name = f"g-{uuid.uuid4().hex[:6]}"
    try:
        _graph_shows_forks(open_page(), gvisor_base, child, grandchild_name, shots)
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(grandchild_name)


def _graph_shows_forks(page: Any, gvisor_base: Any, child: Any, grandchild_name: str,
                       shots: Shots) -> None:
    page.goto(page.url.rstrip("/") + f"/machines/{child.id}")
    sync_api.expect(page.locator("#graph[data-ready='1']")).to_have_count(1)
    graph = page.evaluate("""() => ({
        nodes: window.boxdGraph.nodes().map(n => ({id: n.id(), y: n.position('y'),
                                                    label: n.data('label')})),
        edges: window.boxdGraph.edges().map(e => [e.source().id(), e.target().id()]),
    })""")
    ys = {n["id"]: n["y"] for n in graph["nodes"]}
    assert [gvisor_base.id, child.id] in graph["edges"]
    assert ys[child.id] > ys[gvisor_base.id]  # drawn under its source
    shots(page, "graph")

    # A fork made here, from the page's own action, appears under it after the reload.
    page.get_by_role("button", name=f"Fork {child.name}").click()
    dialog = page.get_by_role("dialog")
    sync_api.expect(dialog).to_be_visible()
    dialog.get_by_label("Name").fill(grandchild_name)
    shots(page, "fork-asks")
    dialog.get_by_role("button", name="Confirm").click()
    sync_api.expect(page.get_by_role("dialog")).to_be_hidden()
    page.wait_for_function(
        "n => window.boxdGraph && window.boxdGraph.nodes().some(x => x.data('label') === n)",
        arg=grandchild_name)
    shots(page, "graph-with-fork")
    graph = page.evaluate("""() => window.boxdGraph.nodes().map(n => ({id: n.id(),
        label: n.data('label'), y: n.position('y'),
        parents: n.incomers('node').map(p => p.id())}))""")
    grand = next(n for n in graph if n["label"] == grandchild_name)
    assert grand["parents"] == [child.id]
    assert grand["y"] > next(n["y"] for n in graph if n["id"] == child.id)

    # Clicking a node opens that machine's page.
    box = page.locator("#graph").bounding_box()
    pos = page.evaluate("id => window.boxdGraph.$id(id).renderedPosition()", grand["id"])
    page.mouse.click(box["x"] + pos["x"], box["y"] + pos["y"])
    page.wait_for_url(f"**/machines/{grand['id']}")
    sync_api.expect(page.get_by_role("heading", level=1)).to_have_text(
        f"Machine {grandchild_name}")


def test_an_action_asks_first_and_works(
        open_page: Callable[..., Any], client: Any, forks: Callable[..., Any],
        shots: Shots) -> None:
    victim = forks()
    page = open_page()
    row = _row(page, victim.id)
    sync_api.expect(row).to_be_visible()
    delete = page.get_by_role("button", name=f"Delete {victim.name}")

    delete.click()
    dialog = page.get_by_role("dialog")
    sync_api.expect(dialog).to_be_visible()
    sync_api.expect(dialog).to_contain_text(f"Delete {victim.name}?")
    shots(page, "asks")
    dialog.get_by_role("button", name="Cancel").click()
    sync_api.expect(dialog).to_be_hidden()
    time.sleep(1.5)  # a request sent anyway would have landed by now
    assert client.machines.get(victim.id).id == victim.id  # nothing happened

    delete.click()
    page.get_by_role("dialog").get_by_role("button", name="Confirm").click()
    sync_api.expect(row).to_have_count(0)  # gone from the table, live
    with pytest.raises(errors.MachineNotFound):
        client.machines.get(victim.id)
    shots(page, "deleted")


def test_another_accounts_machine_is_not_visible_and_answers_404(
        open_page: Callable[..., Any], client: Any, daemon: Any, gvisor_base: Any,
        shots: Shots, page_errors: list[str]) -> None:
    from boxd import Boxd

    account = f"other-{uuid.uuid4().hex[:6]}"
    key = client.keys.create("console-test", account=account).secret
    with Boxd(api_key=key) as other:
        theirs = other.machines.new(f"theirs-{uuid.uuid4().hex[:6]}", engine="gvisor")
        try:
            page = open_page()
            sync_api.expect(_row(page, gvisor_base.id)).to_be_visible()
            sync_api.expect(page.locator("#live")).to_have_text("live")
            assert _row(page, theirs.id).count() == 0
            assert theirs.name not in page.content()
            base = page.url.rstrip("/")
            response = page.goto(f"{base}/machines/{theirs.id}")
            assert response.status == 404
            page_errors[:] = [e for e in page_errors if "404" not in e]  # the browser's
            assert theirs.name not in page.content()
            shots(page, "404")
            api = page.request.get(f"{base}/api/machines/{theirs.id}/graph")
            assert api.status == 404
            # The same machine, on its own account's console, is there.
            env = {**daemon.env(), "BOXD_API_KEY": key}
            ctx = page.context.browser.new_context()
            try:
                theirs_page = ctx.new_page()
                theirs_page.goto(_login_url(env))
                sync_api.expect(_row(theirs_page, theirs.id)).to_be_visible()
                assert _row(theirs_page, gvisor_base.id).count() == 0
            finally:
                ctx.close()
        finally:
            other.machines.delete(theirs.id)


def test_a_url_without_a_valid_token_gets_no_data(
        open_page: Callable[..., Any], daemon: Any, gvisor_base: Any, shots: Shots,
        page_errors: list[str]) -> None:
    url = _login_url(daemon.env())
    base = url.split("/login?")[0]
    page = open_page(login=False)
    for path in ("/", f"/machines/{gvisor_base.id}", "/snapshots",
                 "/login?token=not-a-token", "/login"):
        response = page.goto(base + path)
        assert response.status == 401, path
        text = page.content()
        assert gvisor_base.name not in text and gvisor_base.id not in text, path
    sync_api.expect(page.get_by_role("alert")).to_be_visible()
    shots(page, "login-needed")
    for path in ("/api/machines", "/api/events", f"/api/machines/{gvisor_base.id}/graph"):
        assert page.request.get(base + path).status == 401, path
    assert page.context.cookies() == []
    # A login URL works once: the first browser logs in, a second one does not.
    first = open_page(login=False)
    first.goto(url)
    sync_api.expect(_row(first, gvisor_base.id)).to_be_visible()
    cookie = next(c for c in first.context.cookies() if c["name"] == "boxd_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert first.evaluate("document.cookie") == ""  # no script reads it
    assert page.goto(url).status == 401
    # The pages above answered 401: the browser logs those as console errors.
    page_errors[:] = [e for e in page_errors if "401" not in e]
    # No data over the API key's route either without a key.
    assert httpx.post(base + "/login-tokens").status_code == 401


def test_labels_and_keyboard_navigation(
        open_page: Callable[..., Any], client: Any, gvisor_base: Any,
        forks: Callable[..., Any], shots: Shots) -> None:
    target = forks()
    page = open_page()
    sync_api.expect(_row(page, target.id)).to_be_visible()
    sync_api.expect(page.locator("#live")).to_have_text("live")
    unnamed = page.evaluate("""() => [...document.querySelectorAll(
            'input, select, button, a[href], table')].filter(e => {
        if (e.closest('dialog') && !e.closest('dialog').open) return false;
        const name = e.getAttribute('aria-label') || (e.labels && e.labels.length &&
            e.labels[0].textContent.trim()) || (e.tagName === 'TABLE' && e.caption &&
            e.caption.textContent.trim()) || e.textContent.trim();
        return !name;
    }).map(e => e.outerHTML.slice(0, 80))""")
    assert unnamed == []
    assert page.evaluate("document.documentElement.lang") == "en"

    # The first Tab reaches the skip link, which moves focus to the content.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    for _ in range(5):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "filter-state":
            break
    assert page.evaluate("document.activeElement.id") == "filter-state"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "filter-label"
    page.keyboard.type("no-such-label")
    sync_api.expect(_row(page, target.id)).to_be_hidden()
    page.get_by_label("Label").fill("")
    sync_api.expect(_row(page, target.id)).to_be_visible()

    # An action by keyboard: the dialog takes focus, Escape closes it and gives focus
    # back to the button; nothing happened.
    button = page.get_by_role("button", name=f"Suspend {target.name}")
    button.focus()
    page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog")
    sync_api.expect(dialog).to_be_visible()
    assert page.evaluate("document.activeElement.id") == "confirm-ok"
    shots(page, "dialog-focus")
    page.keyboard.press("Escape")
    sync_api.expect(dialog).to_be_hidden()
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == \
        f"Suspend {target.name}"
    assert client.machines.get(target.id).state == "running"
    # Enter on the focused Confirm does it.
    page.keyboard.press("Enter")
    sync_api.expect(dialog).to_be_visible()
    page.keyboard.press("Enter")
    sync_api.expect(_row(page, target.id).locator("td.state")).to_have_text("suspended")
    assert client.machines.get(target.id).state == "suspended"
    shots(page, "suspended-by-keyboard")


def test_a_saved_report_draws_its_plot(
        open_page: Callable[..., Any], client: Any, gvisor_base: Any, shots: Shots) -> None:
    import functools

    import boxd.rl as rl
    from tests._support import leaky_envs

    sweep = rl.verify(rl.local(), functools.partial(leaky_envs.UrandomEnv, reads_at=4),
                      seeds=range(3), steps=9, pickle_by_value=[leaky_envs])
    data = sweep.to_json()
    data["causes"] = [list(c) for c in sweep.causes]
    name = f"leaky-{uuid.uuid4().hex[:6]}"
    client.reports.save(name, data)
    try:
        page = open_page()
        page.get_by_role("link", name="Reports").click()
        page.get_by_role("link", name=name).click()
        page.wait_for_url(f"**/reports/{name}")
        page.wait_for_selector("body[data-ready='1']")
        charts = page.evaluate("""() => Object.fromEntries(Object.entries(window.boxdCharts)
            .map(([k, c]) => [k, c.data.datasets.map(d => d.data)]))""")
        assert charts["pairs"] == [[0, 3]]
        assert {p["y"] for p in charts["seeds"][0]} == {4}
        drawn = page.evaluate("""() => [...document.querySelectorAll('canvas')].map(c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })""")
        assert len(drawn) == 3 and all(n > 500 for n in drawn), drawn
        sync_api.expect(page.get_by_role("table", name="Likely causes (diverged seeds)")
                        ).to_contain_text("kernel RNG")
        shots(page, "report")
    finally:
        client.reports.delete(name)


# -- a machine's page: its execs, its process's output, its state, live (issue 43) ------

_UNNAMED = """() => [...document.querySelectorAll('input, select, button, a[href], table')]
    .filter(e => {
        if (e.closest('dialog') && !e.closest('dialog').open) return false;
        if (e.closest('[hidden]')) return false;
        const name = e.getAttribute('aria-label') || (e.labels && e.labels.length &&
            e.labels[0].textContent.trim()) || (e.tagName === 'TABLE' && e.caption &&
            e.caption.textContent.trim()) || e.textContent.trim();
        return !name;
    }).map(e => e.outerHTML.slice(0, 80))"""


def _machine_page(open_page: Callable[..., Any], machine_id: str) -> Any:
    page = open_page()
    page.goto(page.url.rstrip("/") + f"/machines/{machine_id}")
    sync_api.expect(page.locator("#live")).to_have_text("live")
    page.evaluate("window.__sameDocument = true")
    return page


def test_a_machines_page_shows_its_execs_live_with_their_exit_codes(
        open_page: Callable[..., Any], client: Any, forks: Callable[..., Any],
        shots: Shots) -> None:
    m = forks()
    client.machines.exec(m.id, "echo before", exec_id="before-page")
    page = _machine_page(open_page, m.id)
    before = page.locator('#execs tbody tr[data-exec="before-page"]')
    sync_api.expect(before.locator("td").nth(0)).to_have_text("echo before")
    sync_api.expect(before.locator("td").nth(1)).to_have_text("0")

    res = client.machines.exec(m.id, ["sh", "-c", "echo failing; exit 3"])
    assert res.exit_code == 3
    row = page.locator(f'#execs tbody tr[data-exec="{res.exec_id}"]')
    sync_api.expect(row).to_be_visible()  # the page's stream brought it: no reload
    assert page.evaluate("window.__sameDocument") is True
    sync_api.expect(row.locator("td").nth(0)).to_have_text("sh -c 'echo failing; exit 3'")
    sync_api.expect(row.locator("td").nth(1)).to_have_text("3")
    sync_api.expect(row.locator("td.exit-bad")).to_have_count(1)
    sync_api.expect(row.locator("td").nth(3)).to_contain_text(" s")  # its duration
    # Newest first.
    ids = page.eval_on_selector_all("#execs tbody tr", "rows => rows.map(r => r.dataset.exec)")
    assert ids[:2] == [res.exec_id, "before-page"]
    shots(page, "execs")


_SERVICE = """
import sys
print("service started", file=sys.stderr, flush=True)
while True:
    head = sys.stdin.buffer.read(4)
    if len(head) < 4:
        break
    msg = sys.stdin.buffer.read(int.from_bytes(head, "big"))
    print("got", msg.decode(), file=sys.stderr, flush=True)
    sys.stdout.buffer.write(head + msg)
    sys.stdout.buffer.flush()
"""


def test_a_processes_output_is_tailed_live_and_its_client_keeps_its_frames(
        open_page: Callable[..., Any], client: Any, forks: Callable[..., Any],
        shots: Shots) -> None:
    m = forks()
    with client.machines.spawn(m.id, ["python3", "-c", _SERVICE]) as proc:
        page = _machine_page(open_page, m.id)
        tail = page.locator("#tail")
        sync_api.expect(page.get_by_label("Process", exact=True)).to_have_value(proc.id)
        sync_api.expect(tail).to_contain_text("service started")
        sync_api.expect(page.locator("#tail-status")).to_have_text("live")
        assert page.evaluate(_UNNAMED) == []

        word = f"hello-{uuid.uuid4().hex[:6]}"
        proc.send(word.encode())  # written after the page loaded
        assert proc.recv(timeout=30) == word.encode()  # the console took no frame
        sync_api.expect(tail).to_contain_text(f"got {word}")
        assert page.evaluate("window.__sameDocument") is True
        shots(page, "tail")

        proc.kill(15)
        sync_api.expect(page.locator("#tail-status")).to_have_text("exited (143)")
        sync_api.expect(page.get_by_label("Process", exact=True)).to_contain_text("exited")
    # The text stays; the stream ended with the process (no reconnects).
    sync_api.expect(tail).to_contain_text(f"got {word}")


def test_the_state_badge_follows_the_machine_live(
        open_page: Callable[..., Any], client: Any, forks: Callable[..., Any],
        shots: Shots) -> None:
    m = forks()
    page = _machine_page(open_page, m.id)
    badge = page.locator("#state")
    sync_api.expect(badge).to_have_text("running")
    client.machines.suspend(m.id)
    sync_api.expect(badge).to_have_text("suspended")
    sync_api.expect(badge).to_have_class("state state-suspended")
    assert page.evaluate("window.__sameDocument") is True
    shots(page, "suspended-live")
    client.machines.resume(m.id)
    sync_api.expect(badge).to_have_text("running")


def test_the_header_names_the_account(
        open_page: Callable[..., Any], client: Any, gvisor_base: Any) -> None:
    local = client.accounts.get("local")
    page = open_page()
    base = page.url.rstrip("/")
    for path in ("/", f"/machines/{gvisor_base.id}", "/snapshots", "/reports"):
        page.goto(base + path)
        header = page.locator("header #account")
        sync_api.expect(header).to_have_text("account local")
        assert local.id not in page.locator("header").inner_text()
