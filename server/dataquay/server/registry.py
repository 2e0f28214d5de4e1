"""The node's dataset registry: names, manifests and their cache sub-databases.

Layout under the state dir::

    datasets/<name>/manifest.dq   the binary manifest
    datasets/<name>/dataset.json  name, root, format, manifest id, cache db, created

Manifests are memory-mapped, so a registered million-sample dataset costs page
cache, not daemon heap. Files are written to a temporary name and renamed, so a
crash never leaves a half-written entry.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dataquay.client.manifest import Manifest, ManifestWriter
from dataquay.server.dirs import ensure_private_dir, private_dir, private_opener
from dataquay.server.errors import DatasetExistsError, ManifestError, UnknownDatasetError
from dataquay.server.manifest_build import is_under

log = logging.getLogger("dataquay.registry")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_dataset_name(name: str) -> str:
    """``name`` if it can name a dataset (a file name and an LMDB key)."""
    if not _NAME.match(name):
        raise ManifestError(
            f"bad dataset name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def cache_db_name(dataset: str, manifest_id: str) -> str:
    """The LMDB sub-database a registration of ``dataset`` caches its samples in."""
    return f"ds:{dataset}:{manifest_id[:16]}"


@dataclass(frozen=True)
class DatasetRecord:
    """What the registry knows of one dataset besides its manifest."""

    name: str
    root: str
    format: str
    manifest_id: str
    cache_db: str
    created: float


@dataclass(frozen=True)
class Registered:
    record: DatasetRecord
    manifest: Manifest


class Registry:
    """Datasets registered on this daemon, loaded at start-up."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "datasets"
        self._datasets: dict[str, Registered] = {}

    def load(self) -> None:
        ensure_private_dir(self.root.parent, "state dir")
        private_dir(self.root)
        for entry in sorted(self.root.iterdir()):
            info = entry / "dataset.json"
            if not info.is_file():
                continue
            try:
                record = DatasetRecord(**json.loads(info.read_text()))
                self._datasets[record.name] = Registered(record, _map_manifest(entry / "manifest.dq"))
            except (OSError, ValueError, TypeError, ManifestError) as exc:
                log.error("skipping a broken registry entry", extra={"fields": {"path": str(entry), "error": str(exc)}})

    def warn_outside(self, dataset_roots: Sequence[Path]) -> None:
        """Logs each registered dataset whose root lies outside ``dataset_roots``.

        Such a dataset was registered under an earlier rule (or before there
        was one) and is still served: the operator allowed it then, and
        dropping it here would throw away a cache that jobs may be reading.
        The warning says how to stop serving it.
        """
        tops = [os.path.realpath(top) for top in dataset_roots]
        for name, entry in sorted(self._datasets.items()):
            if not any(is_under(entry.record.root, top) for top in tops):
                log.warning(
                    "registered dataset lies outside --dataset-roots; still served until dropped "
                    f"(dataquay dataset drop {name})",
                    extra={"fields": {"dataset": name, "root": entry.record.root}},
                )

    def get(self, name: str) -> Registered:
        try:
            return self._datasets[name]
        except KeyError:
            known = ", ".join(sorted(self._datasets)) or "none"
            raise UnknownDatasetError(f"unknown dataset {name!r} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._datasets)

    def check_free(self, name: str, replace: bool) -> None:
        """Raises unless ``name`` may be (re)registered."""
        check_dataset_name(name)
        if name in self._datasets and not replace:
            raise DatasetExistsError(f"dataset {name!r} is already registered (use --replace)")

    def add(
        self, name: str, manifest_source: ManifestWriter | bytes, replace: bool
    ) -> tuple[Registered, Registered | None]:
        """Registers ``name`` from a manifest being built or one built elsewhere
        (the directory's); returns the new entry and the one it replaced."""
        self.check_free(name, replace)
        directory = self.root / name
        private_dir(directory)
        manifest_path = directory / "manifest.dq"
        tmp = manifest_path.with_suffix(".tmp")
        with open(tmp, "wb", opener=private_opener) as out:
            if isinstance(manifest_source, bytes):
                out.write(manifest_source)
            else:
                manifest_source.write(out)
        manifest = _map_manifest(tmp)
        previous = self._datasets.get(name)
        cache_db = cache_db_name(name, manifest.manifest_id)
        content = manifest.content_id()
        if previous is not None and previous.manifest.content_id() == content:
            # The same files registered again (a Slurm job's fresh directory):
            # the cache of the earlier registration holds their bytes.
            cache_db = previous.record.cache_db
        elif twin := next(
            (e for n, e in self._datasets.items() if n != name and e.manifest.content_id() == content), None
        ):
            # The same files under another name: cached once, for both.
            cache_db = twin.record.cache_db
        record = DatasetRecord(
            name=name,
            root=manifest.root,
            format=manifest.format,
            manifest_id=manifest.manifest_id,
            cache_db=cache_db,
            created=time.time(),
        )
        os.replace(tmp, manifest_path)
        info_tmp = directory / "dataset.json.tmp"
        with open(info_tmp, "w", opener=private_opener) as info:
            info.write(json.dumps(asdict(record), indent=1))
        os.replace(info_tmp, directory / "dataset.json")
        self._datasets[name] = Registered(record, manifest)
        return self._datasets[name], previous

    def shared(self, cache_db: str) -> bool:
        """Whether a registered dataset caches its samples in ``cache_db``
        (another name for the same files, once one of them is dropped or replaced)."""
        return any(e.record.cache_db == cache_db for e in self._datasets.values())

    def drop(self, name: str) -> Registered:
        entry = self.get(name)
        directory = self.root / name
        (directory / "dataset.json").unlink(missing_ok=True)
        (directory / "manifest.dq").unlink(missing_ok=True)
        directory.rmdir()
        del self._datasets[name]
        return entry


def _map_manifest(path: Path) -> Manifest:
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot map manifest {path}: {exc}") from exc
    return Manifest(memoryview(mapped))
