"""Queue monitors: internal activation of readers and external activation events."""

from services.activation.service import ActivationService

__all__ = ["ActivationService"]
