"""What every service runs on: Kafka helpers, the catalog store, the ticker, task handlers,
metrics and health, Redis views and the service shell."""
