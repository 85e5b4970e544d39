"""A plugin whose import fails: it must be reported, and the others must still load."""

raise ImportError("p2pkv_fixture_broken cannot be imported (on purpose)")
