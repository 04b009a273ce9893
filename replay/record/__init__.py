"""`replay record`: a recording reverse proxy in front of an OpenAI-compatible server, which
writes a salted hash-id trace of the traffic that passed (docs/record.md)."""
