"""Transmission between broker instances: the transmission queue, its scheduler, links and
suppression, forwarding and ack relays."""
