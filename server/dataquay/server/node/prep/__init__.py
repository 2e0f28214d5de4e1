"""Coordinated prep groups: one group's state, sans-IO (:mod:`.group`), and the daemon's set of
groups that answers members' calls and frees the segments of consumed batches (:mod:`.groups`). It
may import dataquay.client and the server's utilities, and no other room of node/: a prep group
deals batches among trainers and never touches samples, so nothing of reads/, peers/ or exchange/.
"""
