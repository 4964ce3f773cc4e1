"""The tensor names of the text models: the contract between the APIs that speak text
(``app.protocols``: rerank, classify, score, OpenAI's embeddings and completions, TEI's
``/embed_sparse``) and the handlers that serve them (``app.handlers``), declared once. A model's
``model.toml`` declares the ones it takes and gives (docs/text-models.md lists them per handler).
"""

from __future__ import annotations

#: Inputs: the texts (BYTES ``[1]`` an item), the query each is scored against (a rerank's,
#: a cross-encoder's pair), the tokens a prompt keeps (vLLM's ``truncate_prompt_tokens``: its
#: last N), which side of a retrieval model the texts are (0 its default, 1 queries,
#: 2 documents), and a causal-LM scorer's options (the token log-probs listed, how many top
#: alternatives, the greedy next token appended).
TEXT = "text"
QUERY = "query"
TRUNCATE = "truncate_prompt_tokens"
INPUT_TYPE = "input_type"
RETURN_LOGPROBS = "return_token_logprobs"
TOP_LOGPROBS = "top_logprobs"
NEXT_TOKEN = "next_token"

#: Outputs: an embedding, a (query, text) score, class probabilities, a text's tokens and
#: windows, a causal LM's per-token log-probs, a sparse embedding's term ids and weights.
EMBEDDING = "embedding"
SCORE = "score"
PROBABILITIES = "probabilities"
TOKENS = "tokens"
WINDOWS = "windows"
TOKEN_LOGPROBS = "token_logprobs"
INDICES = "indices"
VALUES = "values"
