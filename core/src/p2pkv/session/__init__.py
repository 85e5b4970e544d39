"""The session protocol engine: one :class:`Session` per peer with a consumer
(:mod:`~p2pkv.session.client`) and a producer (:mod:`~p2pkv.session.server`) role, plus the
job ledger and deadline heap the tier shares between sessions."""

from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.env import Claim, LocalIdentity, SessionEnv, SessionHost
from p2pkv.session.ledger import JobLedger
from p2pkv.session.session import Session, State

__all__ = [
    "Claim",
    "Deadlines",
    "JobLedger",
    "LocalIdentity",
    "Session",
    "SessionEnv",
    "SessionHost",
    "State",
    "Timer",
]
