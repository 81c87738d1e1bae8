"""`relayd console`: the operator console in a browser, a process of its own on the operator
role's credentials. Its pages show what `relayd status`, `dlq`, `pause` and `keys` show, from
the same functions; its actions call the functions those commands' verbs call, audited alike.
Needs the `relayd[console]` extra (Jinja2); nothing of it is imported by `relayd run`.
"""
