"""The arithmetic of decoder-only (causal) models, as pure torch functions: what the decoder
handlers compute from a model's outputs, each equal to what the reference libraries compute.

- :func:`last_token_indices` / :func:`last_token_pool`: the last real token of each row, found
  from the attention mask whatever the padding side (a classifier's pooled logits; an
  embedder's last-token pooling); :func:`position_ids` for rows padded on the left;
- :func:`token_log_likelihood`: a text's token log-likelihood under a causal LM (sum, mean,
  perplexity, per-token log-probs), with :func:`scoring_prefix` for the first token;
- :func:`yes_no_score` / :func:`yes_no_score_from_hidden` with :func:`reranker_prompt` and
  :func:`yes_no_token_ids`: a causal LM as a reranker, Qwen3-Reranker's way;
- :func:`embedding_query_prompt`: the instruction prefix of Qwen3-Embedding's queries.

Shapes: ``B`` rows (items), ``T`` tokens per row (padding included, on either side), ``H``
hidden width, ``V`` vocabulary. Masks are 0/1 integer or bool tensors, 1 on real tokens; each
row's real tokens are contiguous (left or right padding, not both in the middle). Nothing here
moves data to the host (no ``.item()``, no ``nonzero``), so it may run in a handler's
``predict`` on a GPU without waiting for the device.

Sources are named per function: transformers 5.x (``GenericForSequenceClassification`` in
``transformers/modeling_layers.py``, ``ForCausalLMLoss`` in ``transformers/loss/loss_utils.py``),
sentence-transformers 6.x (``Pooling`` ``lasttoken``, ``cross_encoder/modules/logit_score.py``),
vLLM (``vllm/model_executor/models/adapters.py``, ``examples/offline_inference/qwen3_reranker.py``),
text-embeddings-inference (Qwen3 support, huggingface/text-embeddings-inference#627, and its
batched last-token fix #646), the model cards of Qwen/Qwen3-Embedding and Qwen/Qwen3-Reranker, and
EleutherAI's lm-evaluation-harness (``prefix_token_id``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "EMBEDDING_DEFAULT_TASK",
    "RERANKER_DEFAULT_INSTRUCTION",
    "RERANKER_PREFIX",
    "RERANKER_SUFFIX",
    "TokenLogLikelihood",
    "embedding_query_prompt",
    "last_token_indices",
    "last_token_pool",
    "position_ids",
    "reranker_prompt",
    "scoring_prefix",
    "token_log_likelihood",
    "yes_no_score",
    "yes_no_score_from_hidden",
    "yes_no_token_ids",
]

#: Bytes of float32 log-softmax work :func:`token_log_likelihood` allows itself at once (rows are
#: taken in chunks under it): 256 MiB, beside the logits the model already holds.
LOG_SOFTMAX_CHUNK_BYTES = 256 * 2**20


def last_token_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of each row's last real token: int64 ``[B]`` from a mask ``[B, T]``.

    The rightmost position whose mask is nonzero, so right padding (``[1, 1, 1, 0]`` -> 2) and
    left padding (``[0, 1, 1, 1]`` -> 3) are both right. A row with no real token gives 0.

    Source: transformers' ``GenericForSequenceClassification.forward`` (5.x) pools the rightmost
    token whose id is not ``pad_token_id`` by this same product-then-argmax; it tests token ids,
    this tests the mask, which differs where the pad token is also a real token of the text
    (Qwen3-Embedding appends ``<|endoftext|>``, its pad token too: Qwen3-Embedding issue #122),
    and works where the tokenizer has no pad token at all (Llama, Vicuna, GPT-2).

    Raises:
        ValueError: the mask is not 2-D.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, T], got shape {tuple(attention_mask.shape)}")
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device, dtype=torch.int64)
    return (positions * (attention_mask != 0)).argmax(dim=-1)


def last_token_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last-token pooling: each row's vector at its last real token, ``[B, H]`` in ``hidden``'s
    dtype, from ``hidden`` ``[B, T, H]`` and ``attention_mask`` ``[B, T]``.

    Also a classifier's pooling: applied to the score head's logits ``[B, T, num_labels]`` it
    gives the ``[B, num_labels]`` logits transformers' ``*ForSequenceClassification`` returns.
    Source: sentence-transformers' ``Pooling(pooling_mode="lasttoken")`` and the last-token pool
    of Qwen3-Embedding's model card (both find the last real token from the mask, either side);
    vLLM's ``LAST`` pooling; TEI #646 (the batched case).

    Raises:
        ValueError: the shapes do not agree.
    """
    if hidden.dim() != 3 or hidden.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"hidden [B, T, H] and attention_mask [B, T] must agree, got {tuple(hidden.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last_token_indices(attention_mask).to(hidden.device)]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own row: int64 ``[B, T]`` from a mask ``[B, T]``,
    counting real tokens from 0 (padding: 0).

    Pass it to the model with left padding: a model of learned absolute positions (GPT-2) would
    otherwise see a row's first real token at the pad count, and its outputs would change with
    the batch it ran in (rotary models are shifted as a whole, which leaves them equal up to
    rounding). Source: transformers' ``GenerationMixin`` (``generation/utils.py``, 5.x) makes
    position ids from the mask the same way (``cumsum - 1``, padding 0).
    """
    real = attention_mask != 0
    return (real.long().cumsum(dim=-1) - 1).masked_fill(~real, 0)


@dataclass(frozen=True)
class TokenLogLikelihood:
    """What :func:`token_log_likelihood` returns, per row (float32 unless said):

    ``total`` ``[B]``: sum over the scored tokens of ``log p(token | tokens before)``, nats;
    ``count`` int64 ``[B]``: tokens scored (each real token that has a real token before it);
    ``mean`` ``[B]``: ``total / count`` (0 where ``count`` is 0); ``perplexity`` ``[B]``:
    ``exp(-mean)`` (1 where ``count`` is 0); ``token_logprobs`` ``[B, T]`` or None: position t
    holds the log-prob of token t, 0 where ``scored`` is False; ``scored`` bool ``[B, T]``;
    ``top_values`` ``[B, T, k]`` and ``top_ids`` int64 ``[B, T, k]`` or None: position t holds
    the k most likely tokens *after* token t (the log-softmax of ``logits[t]``, largest first;
    the last real position's are the text's next token), taken from the same float32
    log-softmax as ``token_logprobs``, so a token that is the most likely one has exactly its
    ``top_values[..., 0]`` as its log-prob."""

    total: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    perplexity: torch.Tensor
    token_logprobs: torch.Tensor | None
    scored: torch.Tensor
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def token_log_likelihood(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    per_token: bool = False,
    top: int = 0,
    chunk_bytes: int = LOG_SOFTMAX_CHUNK_BYTES,
) -> TokenLogLikelihood:
    """The token log-likelihood of each row under a causal LM, from its ``logits`` ``[B, T, V]``
    (any float dtype; computed in float32), ``input_ids`` int64 ``[B, T]`` and
    ``attention_mask`` ``[B, T]``.

    Token t (t >= 1) is scored when it and token t - 1 are real: ``log_softmax(logits[t - 1])``
    at ``input_ids[t]``. The first real token of a row has no context and is not scored: put a
    prefix token before the text to score it (:func:`scoring_prefix`). Padding on either side
    gives the same figures as the row alone. ``per_token``: also return each token's log-prob;
    ``top`` > 0: also the ``top`` most likely tokens after each position (OpenAI's
    ``top_logprobs``; the last position's are the greedy next token's). The log-softmax runs
    over chunks of rows of at most ``chunk_bytes`` of float32 work, so a large vocabulary
    (Qwen's 151,669) does not double the logits' memory at once.

    ``-mean`` equals transformers' causal-LM ``loss`` on the same row (``labels=input_ids``):
    ``ForCausalLMLoss`` shifts the labels by one and averages the cross-entropy over the same
    positions (transformers 5.x ``loss/loss_utils.py``); ``perplexity`` is ``exp(loss)``, as the
    transformers guide "Perplexity of fixed-length models" computes it.

    Raises:
        ValueError: the shapes do not agree.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"logits [B, T, V], input_ids [B, T] and attention_mask [B, T] must agree, got "
            f"{tuple(logits.shape)}, {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
        )
    rows, length, vocab = logits.shape
    real = attention_mask.to(logits.device) != 0
    scored = torch.zeros_like(real)
    scored[:, 1:] = real[:, 1:] & real[:, :-1]
    token_logprobs = torch.zeros((rows, length), dtype=torch.float32, device=logits.device)
    step = max(1, chunk_bytes // max(1, length * vocab * 4))
    # Padding may hold any id (even -1): it is never scored, but gather needs an index in range.
    targets = input_ids.to(logits.device)[:, 1:].clamp(0, vocab - 1).unsqueeze(-1)
    top_values = top_ids = None
    if top > 0:
        top_values = torch.zeros((rows, length, top), dtype=torch.float32, device=logits.device)
        top_ids = torch.zeros((rows, length, top), dtype=torch.int64, device=logits.device)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        # every position, the last included: its distribution is the text's next token's
        log_probs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        token_logprobs[start:stop, 1:] = log_probs[:, :-1].gather(-1, targets[start:stop]).squeeze(-1)
        if top_values is not None and top_ids is not None:
            top_values[start:stop], top_ids[start:stop] = log_probs.topk(top, dim=-1)
    token_logprobs = token_logprobs.masked_fill(~scored, 0.0)
    total = token_logprobs.sum(dim=-1)
    count = scored.sum(dim=-1)
    mean = total / count.clamp(min=1)
    return TokenLogLikelihood(
        total=total,
        count=count,
        mean=mean,
        perplexity=torch.exp(-mean),
        token_logprobs=token_logprobs if per_token else None,
        scored=scored,
        top_values=top_values,
        top_ids=top_ids,
    )


def scoring_prefix(bos_token_id: int | None, eos_token_id: int | None, adds_bos: bool) -> int | None:
    """The token to put before a text's ids so that its first token is scored too, or None.

    None where the tokenizer already puts a BOS token first (Llama, Mistral: their
    post-processor adds ``<s>``); else the model's BOS token, else its EOS token (GPT-2:
    ``<|endoftext|>``; Qwen: its EOS). Source: lm-evaluation-harness scores whole texts
    (``loglikelihood_rolling``) after ``prefix_token_id``, which is the BOS token id, else the
    EOS token id, the text encoded without special tokens."""
    if adds_bos:
        return None
    return bos_token_id if bos_token_id is not None else eos_token_id


#: Qwen3-Reranker's default instruction (its model card's ``format_instruction``).
RERANKER_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
#: What comes before the instruction: the system turn and the start of the user turn.
RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
#: What comes after the document: the end of the user turn and an empty thinking block, so that
#: the next token is the answer.
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The text Qwen3-Reranker scores for ``(query, document)``::

        {RERANKER_PREFIX}<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}
        {RERANKER_SUFFIX}   (on the same line: no newline between the document and the suffix)

    ``instruction`` None: :data:`RERANKER_DEFAULT_INSTRUCTION`. Tokenize it with the model's own
    tokenizer and no special tokens added (the chat tokens are in the text; Qwen adds none
    anyway). A pair too long for the model is cut in its middle part, never in the prefix or the
    suffix (the answer must follow the suffix): the model card tokenizes prefix, middle and
    suffix apart and truncates the middle to ``max_length - len(prefix) - len(suffix)`` tokens;
    uncut, the three apart give the same ids as the whole string (special tokens and newlines
    bound them under Qwen's pre-tokenizer). Source: the Qwen/Qwen3-Reranker-0.6B model card
    (``prefix``, ``suffix``, ``format_instruction``) and vLLM's
    ``examples/offline_inference/qwen3_reranker.py``
    (``query_template = "{prefix}<Instruct>: {instruction}\\n<Query>: {query}\\n"``,
    ``document_template = "<Document>: {doc}{suffix}"``: the same string, cut in two)."""
    instruction = RERANKER_DEFAULT_INSTRUCTION if instruction is None else instruction
    task = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return f"{RERANKER_PREFIX}{task}{RERANKER_SUFFIX}"


def yes_no_token_ids(token_to_id: Callable[[str], int | None]) -> tuple[int, int]:
    """``(yes_id, no_id)``: the vocabulary ids of the tokens ``"yes"`` and ``"no"``, looked up as
    tokens (``tokenizers.Tokenizer.token_to_id``), not by encoding the words: the answer follows
    ``"\\n\\n"``, so it is the bare token, not ``" yes"`` (``"Ġyes"``). Source: the model card,
    sentence-transformers' ``CrossEncoder`` for a ``*ForCausalLM`` folder and vLLM's
    ``load_weights_using_from_2_way_softmax`` all take ``convert_tokens_to_ids("yes")`` and
    ``("no")``.

    Raises:
        ValueError: either token is not in the vocabulary.
    """
    yes, no = token_to_id("yes"), token_to_id("no")
    if yes is None or no is None:
        raise ValueError(
            "this tokenizer has no 'yes' and 'no' tokens: it is not a yes/no reranker's "
            f"(token_to_id('yes') = {yes}, token_to_id('no') = {no})"
        )
    return yes, no


def yes_no_score(last_logits: torch.Tensor, yes_id: int, no_id: int) -> torch.Tensor:
    """A reranker's relevance in (0, 1), float32 ``[B]``, from the logits of each row's last
    real position ``[B, V]`` (:func:`last_token_pool` of the LM's logits; with left padding,
    ``logits[:, -1]``): ``softmax([logit_no, logit_yes])[1]`` = ``sigmoid(logit_yes - logit_no)``.

    Source: the Qwen3-Reranker model card (``log_softmax`` over the stacked no/yes logits, then
    ``exp`` of the yes entry); sentence-transformers' ``LogitScore`` (``logit[yes] - logit[no]``,
    then its ``CrossEncoder``'s default ``Sigmoid``); vLLM's ``from_2_way_softmax`` (a score
    head ``W[yes] - W[no]``, then sigmoid): the same number three ways."""
    pair = last_logits[:, [no_id, yes_id]].float()
    return torch.sigmoid(pair[:, 1] - pair[:, 0])


def yes_no_score_from_hidden(
    last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, yes_id: int, no_id: int
) -> torch.Tensor:
    """:func:`yes_no_score` without the vocabulary-wide logits: float32 ``[B]`` from the final
    hidden state at each row's last real token ``[B, H]`` and the LM head's weight ``[V, H]``
    (no bias, as Qwen's): ``sigmoid(h . (W[yes] - W[no]))``, in float32. Source: vLLM's
    ``load_weights_using_from_2_way_softmax`` (``vllm/model_executor/models/adapters.py``)
    builds this one-row score head at load, which spares the ``[B, T, V]`` logits (the reason it
    gives: 151,669 logits per token for two)."""
    direction = lm_head_weight[yes_id].float() - lm_head_weight[no_id].float()
    return torch.sigmoid(last_hidden.float() @ direction)


#: Qwen3-Embedding's example task (its model card; also the ``query`` prompt of its
#: ``config_sentence_transformers.json``).
EMBEDDING_DEFAULT_TASK = "Given a web search query, retrieve relevant passages that answer the query"


def embedding_query_prompt(query: str, task: str = EMBEDDING_DEFAULT_TASK) -> str:
    """A Qwen3-Embedding query with its instruction: ``f"Instruct: {task}\\nQuery:{query}"`` (no
    space after ``Query:``). Documents take no prefix. The tokenizer then appends
    ``<|endoftext|>`` (its post-processor) and the embedding is the last-token pool of the
    model's last hidden state, L2-normalised.

    Source: the Qwen/Qwen3-Embedding-0.6B model card (``get_detailed_instruct``; "No need to add
    instruction for retrieval documents"), the same string as the ``query`` prompt of its
    ``config_sentence_transformers.json`` (``document`` is ``""``); vLLM and TEI add no prefix
    themselves: the client sends it (vLLM's Qwen3-Embedding example builds it the same way),
    or TEI's ``prompt_name`` picks the sentence-transformers prompt."""
    return f"Instruct: {task}\nQuery:{query}"
