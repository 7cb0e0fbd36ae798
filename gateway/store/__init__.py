"""Where sessions are kept for resume: the interface and the records it keeps (base.py), the memory store
(memory.py), the Redis store (redis.py), the Redis client's options (redis_connection.py), and the factory
that picks one (factory.py).
Nothing here knows the session that uses it."""
