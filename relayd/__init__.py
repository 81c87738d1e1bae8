"""relayd: publishes committed PostgreSQL outbox rows to an Open Job Spec server, at least once."""

__version__ = "0.1.0"
