"""Wire formats and the inference APIs' declarations: the Open Inference Protocol (KServe V2,
JSON and Triton's binary tensors), KServe V1, OpenAI's embeddings, Cohere's rerank and vLLM's
classify (each declared once, ``app.protocols.codec.Api``, listed in ``app.protocols.apis``),
Triton's extensions' documents, and the one inference request type every front end decodes into.

Pure functions from request bytes to numpy arrays and from arrays to response bytes; no aiohttp
and no grpc here. Every malformed input raises :class:`app.errors.InvalidInput` (or another
:mod:`app.errors` type) with a message naming the field that is wrong.
"""
