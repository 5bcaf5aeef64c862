"""The gate between image pushes to a cluster node and a collection of that node's
images (`boxd.control.ray._Gate`): pushes share it, a collection holds it alone, and a
collection waiting for pushes to end goes before pushes that come after it (a steady
stream of pushes cannot starve it)."""

from __future__ import annotations

import asyncio

from boxd.control.ray import _Gate


def test_pushes_share_the_gate_and_a_collection_waits_for_them_then_goes_first() -> None:
    async def main() -> list[str]:
        gate, order = _Gate(), []
        release = asyncio.Event()

        async def push(name: str) -> None:
            async with gate.shared():
                order.append(f"{name} in")
                await release.wait()
                order.append(f"{name} out")

        async def collect() -> None:
            async with gate.alone():
                order.append("collect")
                await asyncio.sleep(0)

        first = [asyncio.create_task(push(n)) for n in ("p1", "p2")]
        await asyncio.sleep(0.01)
        assert order == ["p1 in", "p2 in"]  # shared: both at once
        coll = asyncio.create_task(collect())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(push("p3"))  # after the collection asked
        await asyncio.sleep(0.01)
        assert order == ["p1 in", "p2 in"]  # the collection waits; so does p3, behind it
        release.set()
        await asyncio.gather(*first, coll, late)
        return order

    order = asyncio.run(main())
    assert order.index("collect") > max(order.index("p1 out"), order.index("p2 out"))
    assert order.index("p3 in") > order.index("collect")


def test_a_collection_cancelled_while_waiting_lets_the_pushes_behind_it_go() -> None:
    async def main() -> None:
        gate = _Gate()
        hold = asyncio.Event()

        async def push(ev: asyncio.Event | None) -> None:
            async with gate.shared():
                if ev is not None:
                    await ev.wait()

        running = asyncio.create_task(push(hold))
        await asyncio.sleep(0.01)

        async def collect() -> None:
            async with gate.alone():
                pass

        coll = asyncio.create_task(collect())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(push(None))
        await asyncio.sleep(0.01)
        assert not late.done()
        coll.cancel()
        await asyncio.wait_for(late, 1)  # not stuck behind a collection that left
        hold.set()
        await running

    asyncio.run(main())
