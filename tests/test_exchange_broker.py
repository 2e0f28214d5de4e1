"""What the exchange's sender and receiver tell each other, through the broker
both are built with: no part reaches into the other, none is wired in later."""

from __future__ import annotations

import asyncio

import numpy as np

from dataquay.server.node.exchange.broker import ExchangeBroker


def test_a_receiver_short_of_room_asks_the_sender_built_with_the_same_broker() -> None:
    async def main() -> None:
        broker = ExchangeBroker()
        assert await broker.make_room(4096) == 0  # no sender (yet): nothing to give up, no error
        asked: list[int] = []

        async def give_up(nbytes: int) -> int:
            asked.append(nbytes)
            return 3

        broker.makes_room(give_up)
        assert await broker.make_room(4096) == 3
        assert asked == [4096]

    asyncio.run(main())


def test_an_offer_waits_for_the_coded_pass_into_its_own_epoch_only() -> None:
    async def main() -> None:
        broker = ExchangeBroker()
        started = asyncio.Event()
        ending = asyncio.Event()

        async def coded_pass() -> None:
            with broker.coded_pass("job", 2):
                started.set()
                await ending.wait()

        running = asyncio.create_task(coded_pass())
        await started.wait()
        waiting = asyncio.create_task(broker.coded_pass_over("job", 2))
        await asyncio.wait_for(broker.coded_pass_over("job", 3), 1)  # another epoch: no wait
        await asyncio.wait_for(broker.coded_pass_over("other", 2), 1)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        ending.set()
        await asyncio.wait_for(waiting, 1)
        await running
        await asyncio.wait_for(broker.coded_pass_over("job", 2), 1)  # over: nothing left to wait for

    asyncio.run(main())


def test_a_pass_that_fails_still_lets_its_offers_on() -> None:
    async def main() -> None:
        broker = ExchangeBroker()
        try:
            with broker.coded_pass("job", 1):
                raise OSError("multicast down")
        except OSError:
            pass
        await asyncio.wait_for(broker.coded_pass_over("job", 1), 1)

    asyncio.run(main())


def test_the_sender_keeps_what_the_receiver_answered_held_for_a_later_epoch_until_that_epoch_is_next() -> None:
    broker = ExchangeBroker()
    broker.answered_held("job", 3, np.array([5, 9]))
    broker.answered_held("job", 2, np.array([1]))  # a late offer for an earlier epoch
    broker.answered_held("job", 3, np.array([9, 11]))
    broker.answered_held("other", 3, np.array([7]))
    assert broker.held_beyond("job", 1).tolist() == [1, 5, 9, 11]
    # Epoch 2 is next: what it owns there the sender keeps anyway.
    assert broker.held_beyond("job", 2).tolist() == [5, 9, 11]
    assert broker.held_beyond("job", 3).tolist() == []
    assert broker.held_beyond("other", 1).tolist() == [7]


def test_the_receiver_knows_the_latest_epoch_its_ranks_entered() -> None:
    broker = ExchangeBroker()
    assert broker.entered_epoch("job") == -1
    broker.entered("job", 2)
    broker.entered("job", 1)
    assert broker.entered_epoch("job") == 2
