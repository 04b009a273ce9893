"""Trace replay on Locust: `locust -f locustfile.py --headless --host URL --trace T --tokenizer TOK`.

Only wiring: the options, the placeholder user and the shape live in replay.locust.
"""

from replay.locust import ReplayShape, ReplayUser  # noqa: F401  (Locust finds them here)
