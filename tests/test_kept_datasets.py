"""A daemon's cached datasets across directories: under Slurm each job starts
a directory of its own, which lists nothing until the job registers its
dataset, and the daemon on the user's cache must not drop what it holds."""

from __future__ import annotations

from pathlib import Path

from polling import wait_until
from test_daemon import add, make_files, read, stage, stats, stub_for

from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess


def test_a_dataset_a_fresh_directory_never_listed_is_kept_until_registered_again_or_dropped(tmp_path: Path) -> None:
    roots = (tmp_path / "pfs",)
    root = roots[0] / "imgs"
    payloads = make_files(root, 40, size=500)
    directories = [DirectoryProcess(tmp_path / f"directory-{i}", dataset_roots=roots) for i in (1, 2, 3)]
    first, fresh, third = directories
    first.start()
    daemon = DaemonProcess(tmp_path / "node", ("--directory", first.address), dataset_roots=roots).start()
    try:
        stub = stub_for(daemon)
        add(stub, root)
        assert stage(stub, "imgs").done_samples == 40
        pfs_bytes = stats(stub).pfs_bytes
        assert pfs_bytes == sum(map(len, payloads))
        assert daemon.stop() == 0
        first.kill()

        fresh.start()
        daemon = DaemonProcess(tmp_path / "node", ("--directory", fresh.address), dataset_roots=roots).start()
        _wait_for_sync(daemon, 0)
        stub = stub_for(daemon)
        assert not stub.ListDatasets(pb.ListDatasetsRequest()).datasets
        assert stats(stub).cache_entries == 40

        # Registered again from unchanged files: the cache serves it.
        add(stub, root)
        assert stage(stub, "imgs").done_samples == 40
        assert stats(stub).pfs_bytes == 0
        assert [s.data for s in read(stub, "imgs", [0, 39])] == [payloads[0], payloads[39]]
        fresh.kill()

        # A third directory, and the kept dataset dropped on this node alone.
        third.start()
        assert daemon.stop() == 0
        daemon = DaemonProcess(tmp_path / "node", ("--directory", third.address), dataset_roots=roots).start()
        stub = stub_for(daemon)
        _wait_for_sync(daemon, 1)
        assert stub.DropDataset(pb.DropDatasetRequest(name="imgs")).freed_samples == 40
        assert stats(stub).cache_entries == 0
    finally:
        daemon.kill()
        for directory in directories:
            directory.kill()


def _wait_for_sync(daemon: DaemonProcess, kept_before: int) -> None:
    """Until the daemon, synced with its directory, logged that it keeps the
    dataset (once more than ``kept_before`` times: the log outlives restarts)."""
    wait_until(
        lambda: daemon.log_path.read_text().count("dataset not listed by the directory") > kept_before,
        "the daemon synced with its directory",
    )


def test_a_dataset_added_and_dropped_between_two_heartbeats_is_dropped_on_every_node(tmp_path: Path) -> None:
    """A node that fetched a dataset from its directory drops it with the
    directory, though no heartbeat's listing showed it in between."""
    roots = (tmp_path / "pfs",)
    root = roots[0] / "imgs"
    make_files(root, 40, size=500)
    directory = DirectoryProcess(
        tmp_path / "directory", ("--heartbeat-seconds", "4", "--lease-seconds", "30"), dataset_roots=roots
    ).start()
    daemons = [
        DaemonProcess(
            tmp_path / f"node-{i}", ("--directory", directory.address, "--node-name", f"n{i}"), dataset_roots=roots
        ).start()
        for i in range(2)
    ]
    try:
        first, second = (stub_for(daemon) for daemon in daemons)
        add(first, root)
        stage(second, "imgs")
        assert stats(second).cache_entries > 0
        assert first.DropDataset(pb.DropDatasetRequest(name="imgs")).freed_samples >= 0
        wait_until(lambda: stats(second).cache_entries == 0, "the second node dropped imgs", timeout=30)
        assert not second.ListDatasets(pb.ListDatasetsRequest()).datasets
        assert "dataset not listed by the directory" not in daemons[1].log_path.read_text()
    finally:
        for daemon in daemons:
            daemon.kill()
        directory.kill()
