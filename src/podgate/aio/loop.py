"""Running podgate's event loop: uvloop when it is installed (it roughly doubles relay
throughput per CPU second), asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


async def wait_for_signal() -> int:
    """Until SIGTERM or SIGINT; returns the signal number.

    The handlers stay installed until the loop closes: a second Ctrl-C during the shutdown that
    follows is answered with a line, not raised as KeyboardInterrupt inside the loop (where it
    would leave the shutdown half done: uvloop even crashes on it).
    """
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()

    def on_signal(sig: int) -> None:
        if not got.done():
            got.set_result(sig)
        else:
            print("podgate: already stopping, please wait", file=sys.stderr, flush=True)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    return await got
