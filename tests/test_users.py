"""Users of one daemon kept apart (--users apart), each test the attack of
another uid (setpriv): registering a root it cannot read, reading another
user's dataset by gRPC, by the segment's connection and as a trainer,
joining another user's prep group by name, learning a group's settings
from a refusal, taking every group slot, and handing wrong bytes over for
the cache. The kernel names the caller (SO_PEERCRED): a call on the unix
socket without the ticket that says so is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from one_daemon import files_bytes
from polling import wait_until

import dataquay.client as dq
from dataquay.client.connection import DaemonConnection
from dataquay.client.wire.caller_ticket import METADATA_KEY, CallerTicket
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.memfd import fd_socket_path
from dataquay.client.wire.shm import SHM_DIR, Segment
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.node.users.access import readable_by
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other users and runs as them (root)")

#: The attacker and the user it attacks.
OTHER, VICTIM = 4242, 4343
CALLS = Path(__file__).with_name("user_calls.py")
MEMBER = Path(__file__).with_name("prep_member.py")
SIZES = (3000, 5000)
SAMPLES = 16
#: Prep groups one user may keep in these tests.
PER_USER = 2


def make_dataset(root: Path, seed: int, uid: int = 0, mode: int = 0o755) -> Path:
    """A files dataset at ``root`` of ``uid``: its directories of ``mode``, its files readable as the mode says."""
    synthetic.make_files_dataset(root, SAMPLES, sizes=SIZES, seed=seed, classes=2)
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, uid)
        path.chmod(mode if path.is_dir() else mode & 0o666)
    return root


def digests(payloads: list[bytes]) -> list[str]:
    return [hashlib.sha256(p).hexdigest() for p in payloads]


@dataclass
class Site:
    """A node whose daemon (root) is shared by users: roots under ``pfs``, sockets open to all."""

    base: Path
    pfs: Path
    daemon: DaemonProcess

    def as_user(self, uid: int, command: str, *args: object, groups: str = "") -> Any:
        """What ``command`` of user_calls.py answers, run as ``uid`` (in supplementary ``groups``, e.g. "5,6")."""
        done = subprocess.run(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                f"--groups={groups}" if groups else "--clear-groups",
                sys.executable,
                str(CALLS),
                "--addr",
                self.daemon.address,
                command,
                *map(str, args),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": str(self.base / "out")},
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    def as_root(self) -> DaemonConnection:
        """The daemon's own user's connection (with its caller ticket)."""
        return DaemonConnection(self.daemon.address)

    def add(self, name: str, root: Path) -> None:
        conn = self.as_root()
        try:
            conn.call("AddDataset", lambda stub: stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root))))
        finally:
            conn.close()


@pytest.fixture
def site() -> Iterator[Site]:
    base = Path(tempfile.mkdtemp(prefix="dq-users-", dir="/tmp"))
    base.chmod(0o755)
    pfs, run, out = base / "pfs", base / "run", base / "out"
    for directory, mode in ((pfs, 0o755), (run, 0o755), (out, 0o1777)):
        directory.mkdir()
        directory.chmod(mode)
    daemon = DaemonProcess(
        base / "node",
        ("--users", "apart", "--shared-datasets", "shared", "--prep-groups-per-user", str(PER_USER)),
        dataset_roots=(pfs,),
        socket_path=run / "dataquay.sock",
    )
    daemon.start()
    for sock in run.iterdir():  # the socket group's mode 0660, for any uid of these tests
        sock.chmod(0o666)
    try:
        yield Site(base, pfs, daemon)
    finally:
        daemon.stop()
        shutil.rmtree(base)


def test_a_user_cannot_register_a_root_it_cannot_read_under_an_allowed_root(site: Site) -> None:
    theirs = make_dataset(site.pfs / "theirs", 1, VICTIM, 0o700)
    mine = make_dataset(site.pfs / "mine", 2, OTHER, 0o700)
    refused = site.as_user(OTHER, "add", "stolen", theirs)
    assert refused["error"] == "UserNotAllowedError"
    assert "may register only a root it can read itself" in refused["message"]
    assert str(VICTIM) not in refused["message"]  # the rule, not the root's owner
    assert site.as_user(OTHER, "add", "mine", mine) == {"ok": SAMPLES}
    assert site.as_user(VICTIM, "add", "theirs", theirs) == {"ok": SAMPLES}
    with dq.connect(site.daemon.address) as client:
        assert sorted(d.name for d in client.datasets()) == ["mine", "theirs"]


def test_the_cli_registers_as_its_user(site: Site) -> None:
    theirs = make_dataset(site.pfs / "theirs", 18, VICTIM, 0o700)
    mine = make_dataset(site.pfs / "mine", 19, OTHER, 0o700)

    def cli(uid: int, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                sys.executable,
                "-m",
                "dataquay.server.cli",
                *args,
                "--addr",
                site.daemon.address,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": str(site.base / "out")},
        )

    refused = cli(OTHER, "dataset", "add", "stolen", str(theirs))
    assert refused.returncode == 1 and "may register only a root it can read itself" in refused.stderr
    assert cli(OTHER, "dataset", "add", "mine", str(mine)).returncode == 0
    listed = cli(VICTIM, "dataset", "ls")
    assert listed.returncode == 0 and "mine" in listed.stdout and "stolen" not in listed.stdout


def test_a_user_cannot_register_a_readable_root_that_holds_another_users_private_file(site: Site) -> None:
    mixed = make_dataset(site.pfs / "mixed", 12, OTHER, 0o755)
    private = sorted(mixed.rglob("*.bin"))[3]
    os.chown(private, VICTIM, VICTIM)
    private.chmod(0o600)
    refused = site.as_user(OTHER, "add", "mixed", mixed)
    assert refused["error"] == "UserNotAllowedError"
    assert refused["message"].endswith(f"it cannot read {str(private.relative_to(mixed))!r} there")
    assert site.as_user(VICTIM, "add", "mixed", mixed) == {"ok": SAMPLES}  # who can read every file


def test_a_member_of_the_roots_group_registers_it(site: Site) -> None:
    group = make_dataset(site.pfs / "group", 13, VICTIM, 0o750)
    for path in [group, *group.rglob("*")]:
        os.chown(path, VICTIM, 5555)
    assert site.as_user(OTHER, "add", "group", group)["error"] == "UserNotAllowedError"
    assert site.as_user(OTHER, "add", "group", group, groups="5555") == {"ok": SAMPLES}


def test_a_user_reads_no_byte_of_another_users_private_dataset_by_any_path(site: Site) -> None:
    theirs = make_dataset(site.pfs / "theirs", 3, VICTIM, 0o700)
    assert site.as_user(VICTIM, "add", "theirs", theirs) == {"ok": SAMPLES}
    ids = [0, 1, 5]
    attack = site.as_user(OTHER, "read", "theirs", *ids)
    for path in ("grpc", "segment", "client"):
        assert attack[path]["error"] == "UserNotAllowedError", (path, attack[path])
        assert "ok" not in attack[path]
        assert f"uid {OTHER} may not read dataset 'theirs'" in attack[path]["message"]
    own = site.as_user(VICTIM, "read", "theirs", *ids)
    want = digests(files_bytes(3, ids, SIZES))
    assert own == {"grpc": {"ok": want}, "segment": {"ok": want}, "client": {"ok": want}}
    metrics = urllib.request.urlopen(site.daemon.metrics_url, timeout=10).read().decode()
    assert 'dataquay_user_refusals_total{rule="read"} 3.0' in metrics


def test_a_dataset_the_operator_shares_reads_for_every_user(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 4, 0, 0o700))  # a root no user may read
    ids = [2, 3]
    want = digests(files_bytes(4, ids, SIZES))
    assert site.as_user(OTHER, "read", "shared", *ids) == {
        "grpc": {"ok": want},
        "segment": {"ok": want},
        "client": {"ok": want},
    }


def test_a_user_drops_neither_another_users_dataset_nor_a_shared_one(site: Site) -> None:
    theirs = make_dataset(site.pfs / "theirs", 14, VICTIM, 0o700)
    assert site.as_user(VICTIM, "add", "theirs", theirs) == {"ok": SAMPLES}
    site.add("shared", make_dataset(site.pfs / "kept", 15, 0, 0o700))
    for name in ("theirs", "shared"):
        assert site.as_user(OTHER, "drop", name)["error"] == "UserNotAllowedError"
    assert site.as_user(VICTIM, "drop", "shared")["message"].endswith("only the daemon's own user or root drops it")
    with dq.connect(site.daemon.address) as client:
        assert sorted(d.name for d in client.datasets()) == ["shared", "theirs"]
    assert site.as_user(VICTIM, "drop", "theirs") == {"ok": 0}


def test_another_uid_joining_a_prep_group_by_name_gets_a_group_of_its_own(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 5, 0, 0o700))
    members = []
    for uid in (VICTIM, OTHER):
        out = site.base / "out" / f"member-{uid}.jsonl"
        command = [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            sys.executable,
            str(MEMBER),
            "--addr",
            site.daemon.address,
            "--dataset",
            "shared",
            "--group",
            "sweep",
            "--jobs",
            "2",
            "--batch-size",
            "4",
            "--timeout",
            "4",
            "--out",
            str(out),
        ]
        members.append((subprocess.Popen(command, env={**os.environ, "HOME": str(site.base / "out")}), out))
    for process, _ in members:
        assert process.wait(timeout=90) == 0
    for _, out in members:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        batches = [line for line in lines if "digest" in line]
        # Every batch prepped by its own user: none came from the other uid's member.
        assert len(batches) == SAMPLES // 4 and lines[-1] == {"done": True, "prepped_here": SAMPLES // 4}


def test_a_settings_mismatch_names_the_field_never_the_groups_value(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 6, 0, 0o700))
    first, second = site.as_user(OTHER, "prep", "shared", "g:7", "g:5")["results"]
    assert "ok" in first
    assert second["error"] == "JobMismatchError"
    assert second["message"] == "prep group 'g' has another batch_size than this member; its members must agree"


def test_a_user_takes_no_more_prep_groups_than_its_share(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 7, 0, 0o700))
    groups = [f"g{i}:4" for i in range(PER_USER + 1)]
    *kept, refused = site.as_user(OTHER, "prep", "shared", *groups)["results"]
    assert all("ok" in result for result in kept)
    assert refused["error"] == "InvalidRequestError"
    assert refused["message"] == (
        f"uid {OTHER} already keeps {PER_USER} prep groups on this daemon, as many as one "
        "user may (--prep-groups-per-user)"
    )
    # Another user still has its own share.
    assert all("ok" in result for result in site.as_user(VICTIM, "prep", "shared", "g0:4")["results"])


def test_a_member_cannot_hand_in_another_users_prepped_batch_for_the_daemon_to_remove(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 16, 0, 0o700))
    assert site.daemon.process is not None
    theirs = SHM_DIR / f"dataquay-prep-{site.daemon.process.pid}-{os.getpid()}-0123456789ab"
    theirs.write_bytes(b"\0" * 4096)  # the victim's batch, read by its own group
    try:
        os.chown(theirs, VICTIM, VICTIM)
        refused = site.as_user(OTHER, "steal-segment", "shared", theirs.name)
        assert refused["error"] == "InvalidRequestError"
        assert refused["message"].startswith("a prepped batch must be in a segment of the member's own user")
        time.sleep(1.5)  # the daemon's reaper would have removed what the left group freed
        assert theirs.exists()
    finally:
        theirs.unlink(missing_ok=True)


def test_a_read_cannot_make_the_daemon_write_into_another_users_segment(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 17, 0, 0o700))
    seg = Segment(1 << 20)  # the victim's, awaiting its own batch
    try:
        os.chown(seg.path, VICTIM, VICTIM)
        refused = site.as_user(OTHER, "read-into", "shared", seg.name, 0, 1, 2)
        assert refused["error"] == "UserNotAllowedError"
        assert "only into a segment of the caller's own user" in refused["message"]
        assert bytes(seg.map[:16384]) == bytes(16384)  # not a byte written
    finally:
        seg.close()


def test_a_foreign_users_hand_over_is_not_cached_and_reads_give_the_files_bytes(site: Site) -> None:
    public = make_dataset(site.pfs / "public", 8)
    site.add("public", public)
    seg = Segment(1 << 20)  # the daemon's user's segment, which another user can write
    try:
        seg.path.chmod(0o666)
        assert site.as_user(OTHER, "hand-over", "public", seg.name, 1, SIZES[1]) == {"ok": 0}
    finally:
        seg.close()
    conn = site.as_root()
    try:
        stats = conn.call("Stats", lambda stub: stub.Stats(pb.StatsRequest()))
        assert stats.cache_behind.refused_samples == 1 and stats.cache_behind.handed_samples == 0
        info = conn.call("GetDataset", lambda stub: stub.GetDataset(pb.GetDatasetRequest(name="public")))
        assert info.cached_samples == 0
    finally:
        conn.close()
    with dq.connect(site.daemon.address) as client:
        assert client.dataset("public").get_batch([1]) == files_bytes(8, [1], SIZES)


def test_the_daemons_own_user_still_hands_payloads_over(site: Site) -> None:
    site.add("public", make_dataset(site.pfs / "public", 9))
    want = files_bytes(9, [1], SIZES)[0]
    seg = Segment(1 << 20)
    conn = site.as_root()
    try:
        seg.map[: len(want)] = want
        info = conn.call("GetDataset", lambda stub: stub.GetDataset(pb.GetDatasetRequest(name="public")))
        request = pb.CacheBehindRequest(
            dataset="public",
            manifest_id=info.manifest_id,
            shm_name=seg.name,
            shm_size=seg.size,
            handed=[pb.Sample(id=1, shm_offset=0, length=len(want))],
        )
        assert conn.call("CacheBehind", lambda stub: stub.CacheBehind(request).queued) == 1
    finally:
        seg.close()
        conn.close()


def test_a_call_on_the_unix_socket_without_a_valid_ticket_is_refused(site: Site) -> None:
    site.add("shared", make_dataset(site.pfs / "kept", 10, 0, 0o700))
    refused = site.as_user(OTHER, "no-ticket", "shared")
    assert refused["error"] == "UNAUTHENTICATED" and "caller ticket" in refused["message"]
    ticket = CallerTicket(fd_socket_path(site.daemon.address), "")
    assert ticket.ticket
    with closing(ticket), grpc.insecure_channel(f"unix:{site.daemon.address}", options=channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        request = pb.GetDatasetRequest(name="shared")
        assert stub.GetDataset(request, metadata=ticket.metadata).name == "shared"
        with pytest.raises(grpc.RpcError) as forged:
            stub.GetDataset(request, metadata=((METADATA_KEY, "0" * 32),))
        assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ticket.close()  # the ticket ends with its connection

        def refused_now() -> bool:
            try:
                stub.GetDataset(request, metadata=ticket.metadata)
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAUTHENTICATED
            return False

        wait_until(refused_now, "the daemon forgot the ticket of a closed connection")


def test_registration_over_tcp_is_refused_while_users_are_apart(site: Site) -> None:
    public = make_dataset(site.pfs / "public", 11)
    assert site.daemon.ready is not None
    with grpc.insecure_channel(site.daemon.ready["tcp"], options=channel_options()) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="public", root=str(public)))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not over TCP" in (refused.value.details() or "")


def test_over_tcp_the_cluster_token_reads_only_the_shared_datasets(site: Site) -> None:
    site.add("private", make_dataset(site.pfs / "private", 19, VICTIM, 0o700))
    site.add("shared", make_dataset(site.pfs / "kept", 20, 0, 0o700))
    assert site.daemon.ready is not None
    ids = [1, 2]
    with grpc.insecure_channel(site.daemon.ready["tcp"], options=channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Read(pb.ReadRequest(dataset="private", ids=ids)))
        shared = [s.data for c in stub.Read(pb.ReadRequest(dataset="shared", ids=ids)) for s in c.samples]
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "is not shared" in (refused.value.details() or "")
    assert shared == files_bytes(20, ids, SIZES)


@pytest.mark.parametrize(
    ("modes", "owner", "group", "allowed"),
    [
        ((0o711, 0o700), OTHER, 0, True),  # search alone above, its own root
        ((0o700, 0o755), 0, 0, False),  # a directory above it cannot search
        ((0o755, 0o750), 0, OTHER, True),  # the group's bits for a member
        ((0o755, 0o705), 0, OTHER, False),  # a member gets the group's bits, not the others'
        ((0o755, 0o075), OTHER, 0, False),  # the owner gets the owner's bits only
        ((0o755, 0o701), 0, 0, False),  # search without read: cannot list the root
    ],
)
def test_a_root_is_readable_by_the_modes_along_its_path_as_the_kernel_says(
    modes: tuple[int, int], owner: int, group: int, allowed: bool
) -> None:
    base = Path(tempfile.mkdtemp(prefix="dq-modes-", dir="/tmp"))
    try:
        base.chmod(0o755)
        above, root = base / "above", base / "above" / "root"
        root.mkdir(parents=True)
        above.chmod(modes[0])
        os.chown(root, owner, group)
        root.chmod(modes[1])
        assert readable_by(str(root), OTHER, frozenset({OTHER})) is allowed
        assert readable_by(str(root), 0, frozenset()) is True
    finally:
        shutil.rmtree(base)
