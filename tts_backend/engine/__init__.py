"""The serving engine: request state, urgency scheduler, model runner and the thread that ties them."""
