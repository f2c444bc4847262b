"""`make bench`: raw confluent-kafka against KSB end to end, on an embedded stack of its own.

One run starts Kafka and Redis (`devtools.localstack`), measures a raw produce/consume baseline, then
SEND -> RECEIVE -> commit through a dispatcher child process, and prints both with their ratio.
"""

__all__: list[str] = []
