"""The daemon that runs on every compute node. Its root keeps the wiring and the faces (daemon,
servicer, metrics, datasets, client_stats) and the stager; the work sits in rooms: cache/, reads/,
handoff/, peers/, cluster/, exchange/, prep/, users/. Each room's docstring says what it may import
(tests/test_layout.py holds the table); only daemon.py imports them all."""
