"""The p2pkv conformance kit and test helpers for transport authors.

See ``docs/plugin-authors.md``. Submodules:

``suites``        pytest suites to subclass: ``ControlTransportSuite``, ``DataTransportSuite``
``stateful``      hypothesis state machines per contract: ``ControlTransportMachine``,
                  ``DataTransportMachine``
``tier_machine``  ``TierMachine``: whole tiers over any (control, data) transport pair
``harness``       tiers over the reference memory transports on one fake clock, for tests
``machine``       ``KitMachine``: the machines' base (settings, step log, teardown after failure)
``steps``         the step log: each machine step written down before it runs
``isolated``      ``run_machine_in_child``: a machine in a child process, a crash reported
                  with its steps and seed
``profiles``      the kit's hypothesis profile ``p2pkv``
``strategies``    hypothesis strategies for frames and protocol messages, valid and hostile
``peers``         the other side of a test, in this process or in a child (``PeerHost``)
``child``         run a function in a spawned child with bounded waits (``Child``)
``polllog``       ``PollLog``: checks every ``DataTransport.poll`` against the reporting rules
``waiting``       ``wait_until`` and other bounded-wait helpers
``pytest_plugin`` ``pytest --p2pkv-transport NAME``: the suites over an installed transport
``by_name``       the test module that route collects
"""
