"""The inference APIs this server speaks, one line each (``app.protocols.codec.Api``): the HTTP
front end routes them in this order (the first tried first: the hot path), and the OpenAPI
document lists them."""

from __future__ import annotations

from app.protocols import classify, completions, openai, rerank, score, sparse, v1, v2
from app.protocols.codec import Api

APIS: tuple[Api, ...] = (
    v2.API,
    v1.API,
    openai.API,
    rerank.API,
    classify.API,
    score.API,
    sparse.API,
    completions.API,
)
