"""Conformance suites: pytest test classes a transport author subclasses.

Ten lines prove a data transport (see ``docs/plugin-authors.md``)::

    from p2pkv.testing.suites import DataTransportSuite
    from my_transport import MyDataTransport


    class TestMyDataTransport(DataTransportSuite):
        transport = MyDataTransport
        options = {"my_option": 1}  # your data_options, used for every instance (optional)

The kit builds every instance itself through ``transport.create(settings)``: the transport
under test here, and its peers either in this process (``same-process``) or in a spawned child
(``child-process``, a :class:`p2pkv.testing.peers.PeerHost`), so cross-process behaviour
(including a peer that is SIGKILLed or SIGSTOPped) is tested with no extra code. Tests read the
class's declared :class:`~p2pkv.contracts.Capabilities` and skip, with the reason, what it does
not claim; a transport whose ``availability()`` reports a missing library is skipped as a
whole. A declaration that would skip every pair test (``memory_kinds`` without ``DRAM``;
``same_process_pairs = False`` for a transport that does not claim ``cross_process``; a
``transport_name`` that is not installed) fails them instead, naming what to declare: a run
that tested nothing is never green.

Knobs (class attributes; ``transport_class`` and ``transport_options`` are also fixtures,
which a subclass may override instead):

``transport``            the class under test (or override the ``transport_class`` fixture)
``transport_name``       instead of ``transport``: an installed transport, by registry name
``missing_transport``    ``"fail"`` (default) or ``"skip"`` when ``transport_name`` is not
                         installed
``options``              ``control_options``/``data_options`` for every instance
``timeout``              seconds any single expected event may take (default 10)
``same_process_pairs``   False if two instances cannot share a process
``num_blocks``/``block_len``  the region shape (data)
``max_frame_bytes``      the frame cap used by the suite (control)
``liveness_timeout``     seconds within which a dead or closed peer must show ``alive`` False
``host``                 the host to listen on (control; default ``127.0.0.1``)
``late_landing_window``  seconds the late-landing tests keep both sides progressing after a
                         read was ended (cancel, remove_peer, replacing the peer, close),
                         watching a canary in its slots (data; default 0.5)
``poll_budget``          polls of each side within which one read, alone in an idle process,
                         must complete (data; default 100)
``isolation_rounds``     rounds within which a healthy peer's reads complete while another
                         peer is frozen with transfers in flight (data; default 100)
``call_margin``          ``remove_peer``/``close`` with a frozen peer return within this many
                         driver bounds (``DRIVER_BOUND``, 0.1 s; data; default 5)

The data suites read from the peer into the transport under test (the consumer owns every
write into its region) and, while waiting on a read, always keep the peer side progressing and
polling (a two-sided peer serves reads from there; its ``poll`` must report nothing).

``DataTransportSuite`` includes the isolation checks of ``DataIsolationSuite`` (a peer frozen
mid-transfer never stalls another peer's transfers; ``remove_peer`` and ``close`` never wait
for it); subclass ``DataIsolationSuite`` alone to run only those, e.g. with options that make
the transport's shared budgets small enough for the kit's region to fill.

Individual tests may be overridden or disabled in the subclass like any pytest test
(``test_x = None`` removes one), but a transport that needs that is not conformant.

Import the suites from here; the modules behind it are ``support`` (what every suite
shares), ``data_fixtures`` (what the data suites share), ``data`` with its harness
``data_pair``, ``isolation`` with its harness ``isolation_pair``, ``control``, and
``control_active`` (the checks of ``take_active``, which :class:`ControlTransportSuite`
includes).
"""

from p2pkv.testing.suites.control import ControlTransportSuite as _ControlContract
from p2pkv.testing.suites.control_active import ActiveConnectionChecks
from p2pkv.testing.suites.data import DataTransportSuite
from p2pkv.testing.suites.isolation import DataIsolationSuite
from p2pkv.testing.suites.support import PEER_MODES as PEER_MODES
from p2pkv.testing.suites.support import installed_transport

__all__ = [
    "ControlTransportSuite",
    "DataIsolationSuite",
    "DataTransportSuite",
    "installed_transport",
]


class ControlTransportSuite(_ControlContract, ActiveConnectionChecks):
    """The ``ControlTransport``/``ControlConnection`` contract, ``take_active`` included.
    Subclass and set ``transport``."""
