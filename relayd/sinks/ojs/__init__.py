"""The Open Job Spec destination (`[sink] kind = "ojs"`, the default): each row is the body of
a POST to an OJS server, batched where the server offers it, and a row an earlier attempt may
have stored is looked up by id before it is sent again (docs/ojs.md)."""
