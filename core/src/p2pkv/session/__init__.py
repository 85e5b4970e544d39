"""The session protocol engine: one :class:`Session` per peer with a consumer
(:mod:`~p2pkv.session.client`) and a producer (:mod:`~p2pkv.session.server`) role, plus what
the tier shares between sessions: the job ledger, the deadline heap, the producer directory
and the small cross-session records (:mod:`~p2pkv.session.records`). Connection admission
(:mod:`~p2pkv.session.admission`) and job intake (:mod:`~p2pkv.session.intake`) sit beside."""

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
