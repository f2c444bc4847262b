"""The Python SDK: a client for BEGIN/SEND/END, and RECEIVE under conversation-group locks."""

from ksb.sdk.client import KsbClient, Transaction

__all__ = ["KsbClient", "Transaction"]
