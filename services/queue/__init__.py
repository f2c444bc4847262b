"""The queue service: RECEIVE, COMMIT's outcome and ROLLBACK for clients in any language."""

from services.queue.service import QueueService

__all__ = ["QueueService"]
