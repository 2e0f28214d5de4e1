"""Payloads handed to the trainers on this node: the memfd/shm segments they share with the daemon
(:mod:`.segments`), the unix socket that passes their descriptors (:mod:`.fd_socket`), batch reads
answered on those connections (:mod:`.batch_reads`) and peer payloads written straight into a
trainer's segment (:mod:`.forward`). It may import the reads room (a reply to forward is a read's
result) and users/; never peers/, which hands nothing to a trainer.
"""
