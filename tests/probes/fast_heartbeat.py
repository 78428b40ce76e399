"""Probe run as one rank by tests/test_launch.py: `zerollm ARGS...` with the watchdog's heartbeat every half
millisecond, so that a beat is almost surely in flight when the process ends. A process that ended through
interpreter teardown with a beat in flight aborted ("terminate called without an active exception")."""

from __future__ import annotations

import sys

from llm.cli import main
from llm.runtime.watchdog import Watchdog

_start = Watchdog.__init__


def _fast(self: Watchdog, *args, **kwargs) -> None:
    _start(self, *args, **kwargs)
    self.interval = 0.0005  # read by the thread at every beat


Watchdog.__init__ = _fast
main(sys.argv[1:])
