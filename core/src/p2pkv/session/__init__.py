"""The session protocol engine (internal: not part of p2pkv's public API).

One :class:`Session` per peer holds a consumer role (:mod:`~p2pkv.session.consumer_role`)
and a producer role (:mod:`~p2pkv.session.producer_role`). Beside them sits what the tier
shares between sessions: the job ledger, the deadline heap, the producer directory and the
small cross-session records (:mod:`~p2pkv.session.records`). Connection admission
(:mod:`~p2pkv.session.admission`) and job intake (:mod:`~p2pkv.session.intake`) sit there
too."""

from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.env import LocalIdentity, ReadOwner, SessionEnv, SessionLink
from p2pkv.session.ledger import JobLedger
from p2pkv.session.producers import Claim, ProducerDirectory
from p2pkv.session.session import Session, State

__all__ = [
    "Claim",
    "Deadlines",
    "JobLedger",
    "LocalIdentity",
    "ProducerDirectory",
    "ReadOwner",
    "Session",
    "SessionEnv",
    "SessionLink",
    "State",
    "Timer",
]
