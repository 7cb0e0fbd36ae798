"""The HTTP side of the gateway: the OpenAI-style routes (routes.py), the request guard that checks a
request's key, body size and deadline (guard.py), and the static web demo and JavaScript client (static.py)."""
