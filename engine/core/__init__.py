"""The shared core: requests, the KV block manager, micro-batches, the controller, the policy and executor contracts."""
