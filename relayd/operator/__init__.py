"""The operator surface: the commands that read and act on an outbox from a terminal or a
script (`relayd status`, `check`, `doctor`, `migrate`, `grants`, `healthcheck`, `dlq`, `held`,
`pause`, `resume`), each module a command with its parser beside its handler."""
