"""How often a stopped process leaves the others' new LMDB readers waiting.

LMDB's reader table has one lock, shared by every process that reads the
environment: the daemon and its trainers. A process begins a read
transaction on a slot of its own (taking the lock once) or on one py-lmdb
kept from its last (not taking it). A process stopped (SIGSTOP, a debugger,
a frozen cgroup) while it holds the lock leaves every process that needs a
new slot waiting until it runs again, and py-lmdb waits holding the GIL, so
the whole process waits: no deadline, no signal handler runs. This stops a
process at random moments while four of its threads begin read transactions
in a loop (a busy daemon) and counts the new readers that then waited.

    .venv/bin/python bench/experiments/reader_lock.py [TRIALS]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import progress, report

BEGINNING = """
import lmdb, sys, threading
env = lmdb.open(sys.argv[1], max_readers=512)
def begin_forever():
    while True:
        with env.begin() as txn:
            txn.get(b"k")
for _ in range(4):
    threading.Thread(target=begin_forever, daemon=True).start()
threading.Event().wait()
"""

NEW_READER = """
import lmdb, sys
env = lmdb.open(sys.argv[1], readonly=True, max_readers=512)
txns = [env.begin() for _ in range(3)]
"""

#: A new reader that takes longer than this is counted as waiting on the stopped process.
WAITED_SECONDS = 3.0


def main(trials: int) -> None:
    with tempfile.TemporaryDirectory() as path:
        with lmdb.open(path, max_readers=512) as env, env.begin(write=True) as txn:
            txn.put(b"k", b"v")
        busy = subprocess.Popen([sys.executable, "-c", BEGINNING, path])
        waited = 0
        try:
            time.sleep(1.0)
            for trial in range(trials):
                os.kill(busy.pid, signal.SIGSTOP)
                reader = subprocess.Popen([sys.executable, "-c", NEW_READER, path])
                try:
                    reader.wait(WAITED_SECONDS)
                except subprocess.TimeoutExpired:
                    waited += 1
                os.kill(busy.pid, signal.SIGCONT)
                reader.wait()
                time.sleep(0.02)  # the busy process runs on, to be stopped somewhere else next
                if trial % 50 == 49:
                    progress(f"{trial + 1} of {trials} stops, {waited} new readers waited")
        finally:
            busy.kill()
            busy.wait()
    report(
        "reader_lock",
        [{"stops": trials, "new_readers_waited": waited, "share": round(waited / trials, 3)}],
        ["stops", "new_readers_waited", "share"],
        {"waited_seconds": WAITED_SECONDS},
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
