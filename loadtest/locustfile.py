"""Entry point for `locust -f loadtest/locustfile.py --host URL ...`: the packaged Locust users.

The users, their flags (`--kv-*`, see `locust -f loadtest/locustfile.py --help`) and the workloads live in
`kvrouter.loadgen`; this file only makes them loadable by path from a checkout.
"""

from kvrouter.loadgen.locustfile import OpenAIStreamingUser

__all__ = ["OpenAIStreamingUser"]
