"""The datasets a daemon serves: its own registry, or the directory's.

A standalone daemon builds manifests itself and keeps them in its registry. A
daemon in a cluster relays additions and drops to the directory, which builds
each manifest once, and keeps a copy of every manifest it has used in its
registry: fetched on first use, refreshed when the directory's registry
changes, and still there while the directory is down. A dataset dropped at the
directory is dropped here too, freeing its cache; one replaced there is fetched
again, and its cache kept when the new manifest describes the same files.

A dataset this daemon holds that its directory has not listed since the daemon
started is kept, cache and all, until it is registered again or dropped: under
Slurm each job starts a directory of its own, which lists nothing until the
job's prolog registers the dataset, and the user's cache on the node must
survive into that job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import DirectoryUnavailableError, UnknownDatasetError
from dataquay.server.manifest_build import allowed_root, build_manifest, check_sample_sizes
from dataquay.server.manifest_versions import built_like, unchanged_samples
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.registry import Registered, Registry
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.datasets")


class Datasets:
    """Resolves dataset names to registered manifests and their cache sub-databases."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        tasks: TaskGroup,
        link: DirectoryLink | None = None,
        dataset_roots: Sequence[Path] = (),
        max_sample: int = 1 << 30,
    ) -> None:
        self.registry = registry
        self.store = store
        self.tasks = tasks
        self.link = link
        self.dataset_roots = tuple(dataset_roots)
        self.max_sample = max_sample
        self._builds = asyncio.Semaphore(1)
        self._fetches: dict[str, asyncio.Future[Registered]] = {}
        #: Datasets the directory listed at the last sync: one of these that
        #: goes missing was dropped there.
        self._listed: set[str] = set()
        #: Datasets kept though the directory does not list them, logged once each.
        self._kept: set[str] = set()

    async def entry(self, name: str) -> Registered:
        """The dataset's entry, fetched from the directory on first use.

        Raises:
            UnknownDatasetError: neither this node nor the directory knows it.
        """
        try:
            return self.registry.get(name)
        except UnknownDatasetError:
            if self.link is None:
                raise
        return await self._fetch_once(name)

    async def _fetch_once(self, name: str) -> Registered:
        """Fetches the dataset from the directory, once however many ask at a time."""
        pending = self._fetches.get(name)
        if pending is None:
            pending = self._fetches[name] = self.tasks.spawn_awaited(self._fetch(name), f"fetch-{name}")
            pending.add_done_callback(lambda _: self._fetches.pop(name, None))
        return await asyncio.shield(pending)

    async def _fetch(self, name: str) -> Registered:
        assert self.link is not None
        info, manifest = await self.link.dataset(name)
        entry, previous = self.registry.add(name, manifest, replace=True)
        # The directory answered for it: dropped there later, it goes here too,
        # though no sync saw it listed (added and dropped within one heartbeat).
        self._listed.add(name)
        self._kept.discard(name)
        await self._dropped(previous, entry)
        await self.store.open_dataset(entry.record.cache_db)
        log.info("dataset fetched from the directory", extra={"fields": {"dataset": name, "samples": info.num_samples}})
        return entry

    async def add(
        self,
        request: pb.AddDatasetRequest,
        fmt: str | None,
        may_register: Callable[[str], Awaitable[None]] | None = None,
    ) -> Registered:
        """Registers a dataset: at the directory when there is one, else here.

        The root must lie under this daemon's --dataset-roots even when the
        directory builds the manifest: a daemon relays no root its operator
        has not allowed, whatever the directory's own rule. ``may_register``
        then checks the caller's own right to the root (it raises to refuse),
        before anything is read below it.
        """
        root = allowed_root(request.root, self.dataset_roots, "--dataset-roots / DATAQUAY_DATASET_ROOTS")
        if may_register is not None:
            await may_register(str(root))
        if self.link is not None:
            await self.link.add_dataset(request)
            self._fetches.pop(request.name, None)
            return await self._fetch(request.name)
        self.registry.check_free(request.name, request.replace)
        replaced = self.registry.get(request.name).manifest if request.name in self.registry.names() else None
        grouped = not request.tar_member_samples
        async with self._builds:
            writer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: built_like(replaced, build_manifest(root, fmt, tar_grouped=grouped))
            )
            check_sample_sizes(writer, request.name, self.max_sample, "--max-sample-size")
            entry, previous = self.registry.add(request.name, writer, request.replace)
        await self._dropped(previous, entry)
        log.info(
            "dataset registered",
            extra={
                "fields": {
                    "dataset": request.name,
                    "samples": entry.manifest.num_samples,
                    "format": entry.record.format,
                }
            },
        )
        return entry

    async def drop(self, name: str) -> int:
        """Unregisters the dataset (at the directory too) and frees its cache here.

        A dataset kept here that the directory does not know is dropped here alone.
        """
        if self.link is not None:
            try:
                await self.link.drop_dataset(name)
            except UnknownDatasetError:
                if name not in self.registry.names():
                    raise
            if name not in self.registry.names():
                return 0
        return await self._drop_here(name)

    async def listed(self) -> list[pb.DatasetInfo] | None:
        """The directory's datasets, or None when standalone or the directory is down.

        Listing fetches no manifest: a node copies one when it first serves it.
        """
        if self.link is None:
            return None
        try:
            return await self.link.datasets()
        except DirectoryUnavailableError:
            return None

    async def sync(self) -> None:
        """Follows the directory's registry: drops what it dropped, fetches
        again what it replaced, and keeps what it never listed (see above)."""
        while await self._sync_once():
            pass

    async def _sync_once(self) -> bool:
        """One listing followed; whether a dataset fetched while it was on its
        way is missing from it, to be judged by a listing taken after the fetch
        (the directory's registry may not change again to trigger one)."""
        assert self.link is not None
        listed_before = set(self._listed)
        current = {info.name: info.manifest_id for info in await self.link.datasets()}
        fetched_meanwhile = self._listed - listed_before
        for name in set(self.registry.names()) - fetched_meanwhile:
            listed = current.get(name)
            if listed is None and name in listed_before:
                await self._drop_here(name)
            elif listed is None:
                if name not in self._kept:
                    self._kept.add(name)
                    log.info(
                        "dataset not listed by the directory; its cache is kept until it is registered again "
                        f"or dropped (dataquay dataset drop {name})",
                        extra={"fields": {"dataset": name}},
                    )
            elif listed != self.registry.get(name).record.manifest_id:
                try:
                    await self._fetch_once(name)
                except UnknownDatasetError:
                    await self._drop_here(name)
        self._listed = set(current) | (self._listed - listed_before)
        self._kept &= set(self.registry.names()) - self._listed
        return bool(fetched_meanwhile - set(current))

    async def _drop_here(self, name: str) -> int:
        entry = self.registry.drop(name)
        if self.registry.shared(entry.record.cache_db):
            log.info(
                "dataset dropped; its cache stays for another name of the same files",
                extra={"fields": {"dataset": name}},
            )
            return 0
        freed = await self.store.drop_dataset(entry.record.cache_db)
        log.info("dataset dropped", extra={"fields": {"dataset": name, "freed_samples": freed}})
        return freed

    async def _dropped(self, previous: Registered | None, entry: Registered) -> None:
        """Frees the cache of the version ``entry`` replaced, once its samples
        that the new version still has are moved to their new ids: a changed
        dataset restages only what changed. A job still on the old version
        is told it was replaced (DatasetReplacedError), never served a mix."""
        if previous is None or self.registry.shared(previous.record.cache_db):
            return
        old_ids, new_ids = unchanged_samples(previous.manifest, entry.manifest)
        kept, nbytes = await self.store.carry_over(previous.record.cache_db, entry.record.cache_db, old_ids, new_ids)
        await self.store.drop_dataset(previous.record.cache_db)
        log.info(
            "dataset replaced; its unchanged samples stay cached",
            extra={
                "fields": {
                    "dataset": entry.record.name,
                    "unchanged_samples": len(new_ids),
                    "kept_samples": kept,
                    "kept_bytes": nbytes,
                    "samples": entry.manifest.num_samples,
                }
            },
        )
