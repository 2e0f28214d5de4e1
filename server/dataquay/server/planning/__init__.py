"""Pure planning, no I/O: how many bytes and pages a job's plan keeps on each node (:mod:`.capacity`)
and where a node too small for its share spills the rest (:mod:`.spill`). It may import
dataquay.client and numpy; of the daemon only the write batch's size
(:mod:`dataquay.server.node.cache.write_queue`, constants), so that the CLI, the simulator and the
daemon plan alike without opening a file or a socket.
"""
