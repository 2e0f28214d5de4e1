"""Membership and who owns what: this daemon's link to the directory (:mod:`.directory_link`), the key
that names it there (:mod:`.identity`) and the owners of each dataset's samples across the live
nodes (:mod:`.placements`). It may import the directory's wire types,
:mod:`dataquay.server.planning` and the server's utilities, and no other room of node/: the rooms
that read and ship samples ask it who owns them.
"""
