"""A causal LM as a reranker, Qwen3-Reranker's way: the (query, document) pair written into the
model's judging prompt, and the relevance the probability that the next token is "yes" rather than
"no".

``CausalRerankHandler`` loads a ``*ForCausalLM`` folder (transformers' ``AutoModelForCausalLM``,
local files only; e.g. Qwen/Qwen3-Reranker-0.6B) and scores each item, served by ``/v1/rerank``
and ``/score`` (``app.protocols.rerank``) like a cross-encoder:

- the text is :func:`app.handlers.decoder_math.reranker_prompt` of (query, document, the model's
  ``instruction``), tokenized as the model card does it: the prefix (system turn) and the suffix
  (the empty thinking block after which the answer comes) once at load, without special tokens,
  and the middle (``<Instruct>``, ``<Query>``, ``<Document>``) per item, cut at its end to
  ``max_seq_length`` less the prefix and suffix, so that a long document never pushes the suffix
  out; a query whose part of the middle (the instruction and query lines, up to
  ``<Document>:``) takes more than half of that room is refused (400 naming its tokens and the
  bound: a cross-encoder's rule for a query beside a window, ``app.handlers.windows.split``), so
  that a document is never cut out of its own prompt;
- the score is ``sigmoid(h . (W[yes] - W[no]))`` of the final hidden state ``h`` at each row's
  last real token and the LM head's rows of the tokens ``yes`` and ``no``
  (:func:`app.handlers.decoder_math.yes_no_score_from_hidden`): equal to the model card's
  ``softmax([logit_no, logit_yes])[1]`` without computing the logits of the whole vocabulary
  (151,669 per token for Qwen3), as vLLM's ``from_2_way_softmax`` converts the model.

Inputs: ``text`` (the document) and ``query``, BYTES, per item. Outputs: ``score`` FP32 ``[1]``
(the relevance, in (0, 1)), ``tokens`` INT64 ``[1]`` (the tokens the model ran, the prompt
included), ``windows`` INT64 ``[1]`` (1).

``[parameters]``: those of :mod:`app.handlers.text_config` (``max_seq_length``: tokens per
pair, prompt included; the model card's 8,192 by default where the model allows it),
``instruction`` (the ``<Instruct>`` line; default the model card's web-search one) and
``truncation = "truncate"`` (the only mode: the document is cut at its end, as the model card
cuts it). A model that declares ``truncate_prompt_tokens`` is refused: its cut would take the
prompt's head.

Source: the Qwen/Qwen3-Reranker-0.6B model card (``format_instruction``, ``process_inputs``,
``compute_logits``); vLLM ``examples/offline_inference/qwen3_reranker.py`` and
``load_weights_using_from_2_way_softmax``; sentence-transformers' ``CrossEncoder`` for a
``*ForCausalLM`` folder (``LogitScore``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers import windows as windowing
from app.handlers.decoder_math import (
    RERANKER_DEFAULT_INSTRUCTION,
    RERANKER_PREFIX,
    RERANKER_SUFFIX,
    last_token_pool,
    yes_no_score_from_hidden,
    yes_no_token_ids,
)
from app.handlers.decoders import decoder_features, open_causal_lm, pad_decoder
from app.handlers.text_base import TextHandler
from app.handlers.text_config import (
    SHARED_PARAMETERS,
    ModelConfigLike,
    check_shared_parameters,
    declares_truncation,
)
from app.handlers.tokenizing import Ids, Parts, TextTokenizer, prepared_array
from app.models.base import Priced

__all__ = ["CausalRerankHandler", "RerankBatch"]

_PARAMETERS = (*SHARED_PARAMETERS, "instruction", "truncation")


@dataclass(frozen=True)
class RerankBatch:
    """``preprocess`` output: ``groups`` (the padded length groups on the device), ``position``
    (int64 ``[B]``, each item's row in them) and ``tokens`` (int64 ``[B]`` on the host)."""

    groups: list[dict[str, torch.Tensor]]
    position: torch.Tensor
    tokens: npt.NDArray[np.int64]


class CausalRerankHandler(TextHandler):
    """Scores (``query``, ``text``) pairs with a causal LM's yes/no answer (module docstring)."""

    kind = "CausalRerankHandler"
    #: What runs after the layers, for the memory plan (``app.models.memory.declared_head``).
    MEMORY_HEAD = "base"

    def __init__(self) -> None:
        super().__init__()
        self.instruction = RERANKER_DEFAULT_INSTRUCTION
        self.prefix: Ids = np.zeros(0, dtype=np.int32)
        self.suffix: Ids = np.zeros(0, dtype=np.int32)
        #: The tokens the middle of the prompt may take: ``max_seq_length`` less prefix and suffix.
        self.room = 0
        self.yes_no = (0, 0)

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device`` (local files only), then
        measure the cost model unless ``model.toml`` fixes it.

        Raises:
            ValueError: unknown or bad parameters; a folder that is not a decoder's, or whose
                vocabulary has no ``yes`` and ``no`` tokens; ``max_seq_length`` too short for the
                prompt; a declared ``truncate_prompt_tokens``; ``truncation`` other than
                ``"truncate"``.
            FileNotFoundError: a missing folder.
        """
        parameters = dict(config.parameters)
        check_shared_parameters(config.name, self.kind, parameters, _PARAMETERS)
        if parameters.get("truncation", "truncate") != "truncate" or declares_truncation(config):
            raise ValueError(
                f"model {config.name!r}: a yes/no reranker cuts the document at its end (truncation = "
                '"truncate", no truncate_prompt_tokens input): its prompt must keep its head and tail'
            )
        instruction = parameters.get("instruction", RERANKER_DEFAULT_INSTRUCTION)
        if not isinstance(instruction, str):
            raise ValueError(f"parameters.instruction must be a string, got {instruction!r}")
        path, model, length = open_causal_lm(parameters, config.path, device, config.name)
        self.policy = windowing.WindowPolicy.from_parameters(
            parameters, length, default_truncation="truncate"
        )
        tokenizer = TextTokenizer.from_folder(path, length, pairs=False)
        pad_decoder(tokenizer, path, model.config, config.name)
        self.prefix, self.suffix = tokenizer.encode([RERANKER_PREFIX, RERANKER_SUFFIX], special=False)
        self.room = length - len(self.prefix) - len(self.suffix)
        if self.room < 16:
            raise ValueError(
                f"max_seq_length {length} leaves {self.room} tokens beside the reranker's prompt "
                f"({len(self.prefix) + len(self.suffix)} tokens); give it more"
            )
        self.yes_no = yes_no_token_ids(tokenizer.token_to_id)
        self.instruction, self._tokenizer = instruction, tokenizer
        self.set_device(device)
        self._model = model
        self.calibrate(parameters, self._score)

    # --- per request ----------------------------------------------------------------------

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each pair's prompt ids: prefix, middle (cut to :attr:`room`), suffix (module
        docstring).

        Raises:
            ValueError: a query whose part of the prompt leaves the document too little room.
        """
        self._check_queries(queries)
        middles = [
            f"{self._query_part(query)} {text}" for text, query in zip(texts, queries, strict=True)
        ]
        return [
            (np.concatenate((self.prefix, ids[: self.room], self.suffix)),)
            for ids in self.tokenizer.encode(middles)
        ]

    def _query_part(self, query: str) -> str:
        """The middle of the prompt before the document (the model card's ``format_instruction``
        up to ``<Document>:``)."""
        return f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>:"

    def _check_queries(self, queries: Sequence[str]) -> None:
        """Refuse a query whose part of the prompt takes more than half of :attr:`room` (module
        docstring); only queries whose UTF-8 bytes may reach the bound are tokenized (a token is
        at least a byte, 2b + 1 bounds any tokenizer's count)."""
        limit = self.room // 2
        parts = {q: self._query_part(q) for q in set(queries)}
        wanted = [q for q, part in parts.items() if 2 * len(part.encode()) + 1 > limit]
        if not wanted:
            return
        for count in self.tokenizer.count([parts[q] for q in wanted]):
            if count > limit:
                more = "+" if count >= self.tokenizer.max_length else ""
                raise ValueError(
                    f"a query of {count}{more} tokens (with the reranker's instruction) leaves too little "
                    f"room for a document in the prompt of max_seq_length {self.tokenizer.max_length} "
                    f"tokens ({self.room} beside its system turn and answer); at most {limit}"
                )

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """Tokens each pair makes the model run, int64 ``[B]`` (the prompt included), with its ids
        as its preparation.

        Raises:
            ValueError: invalid UTF-8, a wrong shape, a ``query`` of another length; a query
                that leaves the document too little room (module docstring).
        """
        parts = self.item_parts(inputs)
        costs = np.fromiter((len(p[0]) for p in parts), dtype=np.int64, count=len(parts))
        return Priced(costs, prepared_array(parts))

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> RerankBatch:
        """Pad the items' prompt ids (``inputs[PREPARED]``; tokenized here only where absent) in
        length groups, on the device.

        Raises:
            ValueError: as :meth:`item_costs`.
        """
        parts = self.item_parts(inputs)
        groups, position = self.length_grouped([p[0] for p in parts])
        tokens = np.fromiter((len(p[0]) for p in parts), dtype=np.int64, count=len(parts))
        return RerankBatch(groups, position, tokens)

    def _score(self, group: dict[str, torch.Tensor]) -> torch.Tensor:
        """The relevance of one padded group's rows, float32 ``[U]``: the base model's last
        hidden state at each row's last real token against the LM head's yes and no rows."""
        hidden = self.model.base_model(**decoder_features(group)).last_hidden_state
        last = last_token_pool(hidden, group["attention_mask"])
        weight = self.model.get_output_embeddings().weight
        return yes_no_score_from_hidden(last, weight, *self.yes_no)

    def predict(self, batch: RerankBatch) -> dict[str, Any]:
        """``score`` float32 ``[B, 1]`` on the device; ``tokens`` and ``windows`` on the host."""
        scores = [self._score(group) for group in batch.groups]
        score = (scores[0] if len(scores) == 1 else torch.cat(scores))[batch.position]
        return {"score": score.reshape(-1, 1), "tokens": batch.tokens.reshape(-1, 1)}

    def postprocess(self, outputs: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
        """Host numpy arrays, ``[B, 1]`` each: FP32 ``score``, INT64 ``tokens`` and ``windows``."""
        tokens = np.asarray(outputs["tokens"], dtype=np.int64)
        return {
            "score": outputs["score"].to("cpu", torch.float32).numpy(),
            "tokens": tokens,
            "windows": np.ones_like(tokens),
        }
