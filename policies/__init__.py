"""Scheduling policies, one module each; importing this package registers them all in
`engine.policy.POLICIES`."""
from importlib import import_module

for _module in ("sarathi", "vllm", "gllm", "tdpipe", "sipipe", "molink"):
    import_module(f"policies.{_module}")
