"""One owner of template lifetime (node/_template_refs.py `TemplateRefs`): a template
lives while any holder keeps a reference; collection asks only that. The pure logic,
then the node on the fake engine: a standby fork child holds its template's files
until it is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests._support.fake_world import ACCOUNT, make_world, running

from boxd.node._template_refs import TemplateRefs


def test_the_last_release_of_any_holder_frees_the_template() -> None:
    freed: list[str] = []
    refs = TemplateRefs(freed.append)
    refs.acquire("t1", "launch")
    refs.acquire("t1", "launch")
    refs.acquire("t1", "standby:m_1")
    assert refs.held() == {"t1"}
    assert refs.holders("t1") == {"launch": 2, "standby:m_1": 1}
    refs.release("t1", "launch")
    refs.release("t1", "standby:m_1")
    assert freed == [] and refs.held() == {"t1"}  # one launch still holds it
    refs.release("t1", "launch")
    assert freed == ["t1"] and refs.held() == set()


def test_releasing_what_a_holder_does_not_hold_changes_nothing() -> None:
    freed: list[str] = []
    refs = TemplateRefs(freed.append)
    refs.release("t1", "launch")  # never held: no free, no negative count
    refs.acquire("t1", "received:m_src")
    refs.release("t1", "standby:m_9")  # another holder's name
    refs.release("t1", "received:m_src")
    refs.release("t1", "received:m_src")  # a clean-up path run twice
    assert freed == ["t1"] and refs.holders("t1") == {}


def test_a_standby_fork_holds_its_templates_files_until_it_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a warmed source used to collect its template (files and all) at once,
    while its standby children, killed after in the background, still mapped them. Now
    each standby child holds a reference: the template goes with the last of them."""
    w = make_world(tmp_path, monkeypatch, spares=2)

    async def main() -> None:
        src = await running(w)
        assert (await w.machines.warm(ACCOUNT, src.id, 2)).forks == 2
        rec = w.repos.machines.get(src.id)
        assert rec is not None
        tpl = w.repos.layers.template_for(src.id, rec.generation)
        assert tpl is not None and tpl.mem_path.exists()
        seen: list[bool] = []
        for spare in w.node.spares.ready():
            destroy = spare.handle.destroy

            async def destroying(destroy=destroy) -> None:  # type: ignore[no-untyped-def]
                seen.append(tpl.mem_path.exists())  # its files, as it dies
                await destroy()

            spare.handle.destroy = destroying  # type: ignore[method-assign]
        await w.machines.delete(ACCOUNT, src.id)
        for _ in range(200):
            if len(seen) == 2 and not tpl.mem_path.parent.exists():
                break
            await asyncio.sleep(0.01)
        assert seen == [True, True]
        assert not tpl.mem_path.parent.exists()  # collected once the last one went
        assert w.repos.layers.template(tpl.id) is None
        assert w.node.templates.refs.held() == set()
        await w.node.spares.close()

    try:
        asyncio.run(main())
    finally:
        w.repos.db.close()
