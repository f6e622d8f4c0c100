"""Data-parallel serving (``corerun serve --data-parallel-size N``): N engine replicas, each in its own
process, behind one API server. ``front.py`` is what the server serves, ``client.py`` its end of one
replica, ``replica.py`` the replica process, ``router.py`` which replica takes a request."""
