"""`testbed serve`: an OpenAI-compatible HTTP server over the testbed's own engine.

    testbed serve executor=torch model=tiny-llama parallel.pp=2 kv.num_blocks=256 serve.port=8000
    testbed serve executor=sim model=llama2-70b hardware=a100-80g parallel.pp=4 policy=gllm

Modules: settings.py (the `serve.*` config section), protocol.py (request bodies and OpenAI-style
errors), codec.py (text <-> token ids), engine_loop.py (the engine thread driving the same
Controller and policy as `testbed run`, through the controller's online API), metrics.py
(Prometheus), app.py (the ASGI routes), main.py (start-up, signals, MLflow). The benchmark
client that replays workloads against any such server is testbed/bench/serve.py.

Importing this package is cheap (the config layer reads `ServeSettings`); the server's
dependencies are imported by the modules that need them.
"""
from testbed.config.serve import ServeSettings

__all__ = ["ServeSettings"]
