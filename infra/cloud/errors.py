"""The cloud driver's error (its own module, so that the driver's helpers raise it too)."""

from __future__ import annotations

from backend.errors import FedgateError


class CloudError(FedgateError):
    """A cloud region could not be added, removed or read; the message says what to do."""
