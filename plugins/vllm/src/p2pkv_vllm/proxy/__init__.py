"""``p2pkv proxy``: OpenAI-compatible PD router (config, selection, legs, ASGI app, server).

``config``, ``selection`` and ``legs`` are pure stdlib; ``app`` and ``server`` need the
``proxy`` extra (aiohttp, uvicorn).
"""
