"""Dialogs: the dispatcher's pure rules (begin, send, end, receipts and fences, timers, remote
windows) and the endpoint state machine they drive."""
