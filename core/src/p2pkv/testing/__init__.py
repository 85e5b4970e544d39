"""The p2pkv conformance kit and test helpers for transport authors.

See ``docs/plugin-authors.md``. Submodules: ``child`` (run the remote side of a test in a
child process), ``suites`` (pytest suites to subclass), ``stateful`` (hypothesis state
machines), ``strategies`` (valid and hostile protocol messages and frames).
"""
