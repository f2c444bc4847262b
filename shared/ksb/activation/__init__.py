"""Activation: queue monitors, poison-message handling, external activation and activated tasks."""
