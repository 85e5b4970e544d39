"""The roles :class:`p2pkv.tier.P2PTier` is made of; ``P2PTier`` delegates to them.

- :mod:`.table`: the sessions, by peer and by connection, and the sets that tell a tick
  which sessions have something due.
- :mod:`.tick`: one tick of I/O, proportional to what is due, not to the sessions open.
- :mod:`.requests`: the engine's calls about requests (routing, lookups, jobs).
- :mod:`.dialer`: finding or dialing the session for a peer, within ``peers.*``.
- :mod:`.backoff`: the negative cache of addresses whose dial failed.
- :mod:`.warm`: the bounded set of peers kept connected before any request (``peers.connect``).
- :mod:`.domains`: a lost peer makes its host suspect; its sibling ranks are probed.
- :mod:`.shutdown`: winding the tier down within its budget.
- :mod:`.views`: the read-only views (``stats``, ``state_sizes``).

Threading: driver thread only, like the tier.
"""
