"""Outbound sinks: where relayd publishes rows."""
