"""Model runtime: the handler contract and a batch's result (``base``), the built-in loaders, the
runner, and the model repository.

Nothing here imports aiohttp; the runner and the loaders run on the model's threads. This package
imports nothing itself, so that the request path (the serving core, the routes) can
use ``repository`` and ``base`` without importing torch.
"""
