"""The one root of fedgate's expected errors.

Every failure fedgate expects -- a wrong setting, a node that does not
answer, Kafka away, a region that cannot be added -- is a FedgateError, so a
command line or a service catches one class and prints one line (the
traceback goes to the debug log).  `retriable` says whether the same call may
succeed later without anyone changing anything (a node still starting, a
network blip) or not (a wrong setting, a missing object): callers that retry
look at it instead of matching messages.
"""

from __future__ import annotations


class FedgateError(Exception):
    """An expected failure; the message is meant for the operator as it is."""

    #: The default of a class; a raise may override it (`retriable=`).
    retriable: bool = False

    def __init__(self, msg: str = "", *, retriable: bool | None = None):
        super().__init__(msg)
        if retriable is not None:
            self.retriable = retriable
