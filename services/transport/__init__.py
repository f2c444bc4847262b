"""The transport: the links to other broker instances.

The transport's logic is `ksb.transport` and it runs inside the transmitter process
(`services.transmitter`), which owns the connections: on Kafka a connection is a producer and an ack
consumer, so a separate process would only add a hand-off. This shell keeps the periodic timer for
deployments that already start it.
"""
