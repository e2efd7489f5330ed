"""The simulated vLLM replica: engine models (pure), profiles, the HTTP server and the KV-event publisher.

Nothing here imports the router's hashing or index code: the simulator is the independent judge of the
router's predictions.
"""
