"""What the HTTP destinations (OJS, webhooks) share: one bounded exchange over a kept-alive
session (`exchange.py`) and reading its answer (`answers.py`)."""
