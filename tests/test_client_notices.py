"""Warnings told once between the processes of a trainer's process group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from polling import wait_until

_LEADERLESS = """
import os, sys, time
from dataquay.client.wire.notices import first_to_tell, no_longer
if os.fork():
    os._exit(0)  # the group's leader leaves, as a shell that started a trainer in the background
time.sleep(0.5)  # its parent has reaped it by now
told = (first_to_tell("daemon down: test"), first_to_tell("daemon down: test"))
no_longer("daemon down: test")
with open(sys.argv[1] + ".part", "w") as f:
    f.write(" ".join(map(str, told)))
os.rename(sys.argv[1] + ".part", sys.argv[1])
"""


def test_a_group_whose_leader_has_gone_still_tells_a_topic_once(tmp_path: Path) -> None:
    out = tmp_path / "told"
    subprocess.run([sys.executable, "-c", _LEADERLESS, str(out)], check=True, timeout=60, start_new_session=True)
    wait_until(out.exists, "the leaderless process told")
    assert out.read_text().split() == ["True", "False"]
