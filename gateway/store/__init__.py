"""Where sessions are kept for resume: the interface and the memory store (base.py), the Redis store
(redis.py), the Redis client's options (redis_connection.py), and the factory that picks one (factory.py).
Nothing here knows the session that uses it."""
