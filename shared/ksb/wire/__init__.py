"""The wire: every record any Kafka client reads or writes, and how records find their partition."""
