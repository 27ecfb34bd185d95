"""The save and load pipelines: planning protocol, staging, writers, read plans, exchange."""
