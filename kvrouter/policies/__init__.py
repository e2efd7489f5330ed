"""Routing policies: one module each behind `kvrouter.policies.base.Policy`; `build_policy` is the factory."""
