"""The forwarder: passes on messages that arrive for services this instance does not host.

It will read `inbound` records addressed elsewhere and send them to the next hop, dropping any it
could not forward in time. On a single instance every message is for a local service, so the
forwarder has no work yet: today it only runs the periodic timer, serves metrics and stops
cleanly. Cross-instance delivery is issue 5.
"""
