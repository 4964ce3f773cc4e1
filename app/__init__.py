"""Multi-GPU PyTorch model scoring server.

Gunicorn forks aiohttp workers; each worker binds itself to one GPU (``gpu_stat``),
loads the models of a model repository onto it, and serves the KServe V1 and
Open Inference Protocol (KServe V2) REST APIs with dynamic batching.
"""

__version__ = "0.1.0"
SERVER_NAME = "scoring-server"
