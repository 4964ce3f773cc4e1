"""Wire formats: KServe V1 and the Open Inference Protocol (KServe V2) JSON REST.

Pure functions from request bytes to numpy arrays and from arrays to response
bytes; no aiohttp here. Every malformed input raises :class:`app.errors.InvalidInput`
with a message naming the field that is wrong.
"""
