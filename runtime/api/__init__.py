"""The OpenAI HTTP API: a request core (core.py) under sibling routers (completions, chat,
responses, tokenize, admin), assembled into the ``Server`` by app.py (docs/architecture.md)."""
