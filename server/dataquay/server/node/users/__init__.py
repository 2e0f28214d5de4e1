"""Users of one daemon kept apart: who calls (:mod:`.callers`) and what that user may do
(:mod:`.access`). It may import the server's auth and interceptors, and no other room of node/.
"""
