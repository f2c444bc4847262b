"""KSB: Service Broker conversations on Kafka.

The importable common library: protocol, catalog, client SDK, locks, clock and settings.
"""
