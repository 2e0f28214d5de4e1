"""The LMDB cache and its one writer: the cache directory and its files (:mod:`.dir`, :mod:`.file`),
the room they may fill (:mod:`.space`), the store that reads them (:mod:`.store`), the single thread
that writes them (:mod:`.store_writer`, fed by :mod:`.write_queue`), the rule every value passes
before it is written (:mod:`.admission`), and what gives way when room is needed, charged to whom
(:mod:`.eviction`, pure, and :mod:`.manager`). It may import dataquay.client, dataquay.protos, the
server's utilities and :mod:`dataquay.server.planning`, and no other room of node/: every other room
builds on it.
"""
