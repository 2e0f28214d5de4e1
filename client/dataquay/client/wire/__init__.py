"""The wire core that the trainer's client and the daemon both import.

What crosses a hop between a trainer and its daemon, or between daemons, is
written once here: the record layout of keys and cache values and its compiled
loops, pieces and their checksums, read-stream parsing, memfd and /dev/shm
segments with the framed batch reads on their socket, channel options, the
status map, tier names, caller tickets and the credential checks. The
trainer's API (connect, datasets, samplers) sits one level up and the daemon
under dataquay.server; neither is imported from here.
"""
