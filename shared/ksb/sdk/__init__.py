"""The Python SDK: a client for BEGIN/SEND/END, and RECEIVE under conversation-group locks."""
