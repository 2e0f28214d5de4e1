"""Serving a batch: from this node's cache, from the owners, from the PFS (:mod:`.service`,
:mod:`.pfs`, with overflow reads in :mod:`.overflow` and replies shaped in :mod:`.replies`), reading
ahead of a job (:mod:`.prefetch`) and caching behind the trainers (:mod:`.behind`). It may import
the cache, cluster and peers rooms, handoff's segments (caching behind reads a trainer's segment),
and node/'s datasets and metrics; nothing of prep/, exchange/ or users/.
"""
