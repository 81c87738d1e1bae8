"""What a user may run against their own code, shipped with relayd: the OJS emulator
(`relayd emulator`), the embedded PostgreSQL and nats-server, the webhook receiver that
verifies every signature, and running relayd's own commands as child processes."""
