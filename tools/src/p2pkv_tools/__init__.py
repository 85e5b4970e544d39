"""p2pkv-tools: the ``p2pkv demo``, ``p2pkv bench`` and ``p2pkv doctor`` commands.

A plugin of p2pkv (entry point ``tools`` in the ``p2pkv`` group, module
:mod:`p2pkv_tools.plugin`), installed by ``pip install 'p2pkv[cli]'``. Subpackages:
``demo`` (a verified KV request stream between two processes), ``bench`` (transports
against the raw libraries and memcpy, and whole tiers), ``doctor`` (this host's
diagnosis). An engine never imports it.
"""
