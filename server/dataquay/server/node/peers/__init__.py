"""Daemon to daemon: reading samples from the peers that own them over gRPC or the bulk path
(:mod:`.reads`), and the bulk path itself (:mod:`.bulk`: a framed TCP stream, its listener and its
readers). It may import the cache room (the bulk listener serves from the store) and the server's
utilities; never handoff/, which is about this node's trainers.
"""
