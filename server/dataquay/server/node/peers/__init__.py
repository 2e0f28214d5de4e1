"""Daemon to daemon: reading samples from the peers that own them (:mod:`.reads`), over the transport
picked for each read (:mod:`.transports`: the bulk path or a gRPC stream), and the bulk path itself
(:mod:`.bulk`: a framed TCP stream, its listener and its readers). It may import the cache room (the
bulk listener serves from the store; a peer's samples pass the admission rule) and the server's
utilities; never handoff/, which is about this node's trainers.
"""
