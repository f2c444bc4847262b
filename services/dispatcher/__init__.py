"""The dispatcher: the only writer of endpoint state and of queue topics."""

from services.dispatcher.service import Dispatcher

__all__ = ["Dispatcher"]
