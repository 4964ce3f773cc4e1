"""A causal LM as a reranker, Qwen3-Reranker's way: the (query, document) pair written into the
model's judging prompt, and the relevance the probability that the next token is "yes" rather than
"no".

``CausalRerankHandler`` loads a ``*ForCausalLM`` folder (transformers' ``AutoModelForCausalLM``,
local files only; e.g. Qwen/Qwen3-Reranker-0.6B) and scores each item, served by ``/v1/rerank``
and ``/score`` (``app.protocols.rerank``) like a cross-encoder:

- the text is :func:`app.handlers.decoder_math.reranker_prompt` of (query, document, the model's
  ``instruction``), tokenized as the model card does it, without special tokens: the system turn
  and the suffix (the empty thinking block after which the answer comes) once at load, the query
  part of the middle (``<Instruct>`` and ``<Query>`` lines, up to ``<Document>:``) once per
  distinct query of a request, and the document (with the space before it) per item, cut at its
  end to ``max_seq_length`` less the rest, so that a long document never pushes the suffix out
  (the prompt splits into the same tokens whole: Qwen's pre-tokenizer never joins ``:`` and the
  space after it); a query whose part takes more than half of what the system turn and the
  suffix leave is refused (400 naming its tokens and the bound: a cross-encoder's rule for a query
  beside a window, ``app.models.windows.split``), so that a document is never cut out of its
  own prompt;
- the **shared prefix** (the system turn, the instruction and the query: everything before the
  document) is computed once per distinct query of a batch, each document and the suffix run
  against its keys and values (:mod:`app.handlers.prefix_sharing`), and kept in the prefix cache
  for the next request with the same query (its next page of documents); each score equals the
  pair scored alone within float rounding;
- the score is ``sigmoid(h . (W[yes] - W[no]))`` of the final hidden state ``h`` at each row's
  last real token and the LM head's rows of the tokens ``yes`` and ``no``
  (:func:`app.handlers.decoder_math.yes_no_score_from_hidden`): equal to the model card's
  ``softmax([logit_no, logit_yes])[1]`` without computing the logits of the whole vocabulary
  (151,669 per token for Qwen3), as vLLM's ``from_2_way_softmax`` converts the model.

Inputs: ``text`` (the document) and ``query``, BYTES, per item. Outputs: ``score`` FP32 ``[1]``
(the relevance, in (0, 1)), ``tokens`` INT64 ``[1]`` (the tokens of the pair's prompt, the shared
prefix included however often it ran), ``windows`` INT64 ``[1]`` (1).

``[parameters]``: those of :mod:`app.handlers.text_config` (``max_seq_length``: tokens per
pair, prompt included; the model card's 8,192 by default where the model allows it),
``instruction`` (the ``<Instruct>`` line; default the model card's web-search one),
``truncation = "truncate"`` (the only mode: the document is cut at its end, as the model card
cuts it), ``shared_prefix`` and ``prefix_cache_bytes`` (:mod:`app.handlers.prefix_sharing`). A
model that declares ``truncate_prompt_tokens`` is refused: its cut would take the prompt's head.

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

from app.handlers import prefix_sharing
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
from app.models import windows as windowing
from app.models.base import Priced

__all__ = ["CausalRerankHandler", "RerankBatch"]

_PARAMETERS = (*SHARED_PARAMETERS, "instruction", "truncation", *prefix_sharing.PARAMETERS)


@dataclass(frozen=True)
class RerankBatch:
    """``preprocess`` output: ``groups`` (the padded length groups on the device: the items run
    whole), ``shared`` (the items run after their shared prefix; None: none), ``position`` (int64
    ``[B]``, each item's row in the groups' results then the shared calls', concatenated) and
    ``tokens`` (int64 ``[B]`` on the host)."""

    groups: list[dict[str, torch.Tensor]]
    position: torch.Tensor
    tokens: npt.NDArray[np.int64]
    shared: prefix_sharing.SharedRun | None = None


class CausalRerankHandler(TextHandler):
    """Scores (``query``, ``text``) pairs with a causal LM's yes/no answer (module docstring)."""

    kind = "CausalRerankHandler"
    #: What runs after the layers, for the memory plan (``app.models.memory.declared_head``).
    MEMORY_HEAD = "base"
    #: Whether the model keeps a prefix cache, for the memory plan (``app.models.memory``).
    MEMORY_PREFIX_CACHE = True

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
        identity = (config.name, str(getattr(config, "version", "")))
        self.sharing = prefix_sharing.PrefixSharing.from_parameters(model, parameters, identity, config.name)
        self.set_device(device)
        self._model = model
        self.calibrate(parameters, self._score)

    # --- per request ----------------------------------------------------------------------

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each pair's prompt ids (system turn, query part, document cut to what :attr:`room`
        leaves, suffix) and its split (the tokens before the document: the shared prefix;
        module docstring).

        Raises:
            ValueError: a query whose part of the prompt leaves the document too little room.
        """
        heads = self._query_heads(queries)
        documents = self.tokenizer.encode([f" {text}" for text in texts], special=False)
        out: list[Parts] = []
        for query, document in zip(queries, documents, strict=True):
            head = heads[query]
            ids = np.concatenate((head, document[: self.room - len(head) + len(self.prefix)], self.suffix))
            out.append((ids, prefix_sharing.split_row(len(head))))
        return out

    def _query_part(self, query: str) -> str:
        """The middle of the prompt before the document (the model card's ``format_instruction``
        up to ``<Document>:``)."""
        return f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>:"

    def _query_heads(self, queries: Sequence[str]) -> dict[str, Ids]:
        """Each distinct query's prompt head (the system turn and its query part, tokenized once),
        refusing a query part that takes more than half of :attr:`room` (module docstring)."""
        distinct = list(dict.fromkeys(queries))
        limit = self.room // 2
        heads = {}
        encoded = self.tokenizer.encode([self._query_part(q) for q in distinct], special=False)
        for query, ids in zip(distinct, encoded, strict=True):
            if len(ids) > limit:
                more = "+" if len(ids) >= self.tokenizer.max_length else ""
                raise ValueError(
                    f"a query of {len(ids)}{more} tokens (with the reranker's instruction) leaves too little "
                    f"room for a document in the prompt of max_seq_length {self.tokenizer.max_length} "
                    f"tokens ({self.room} beside its system turn and answer); at most {limit}"
                )
            heads[query] = np.concatenate((self.prefix, ids))
        return heads

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """Tokens each pair makes the model run, int64 ``[B]`` (its prompt's; after a shared
        prefix its own and its share of the prefix's, :meth:`prefix_sharing.PrefixSharing.costs`),
        with its ids and split as its preparation.

        Raises:
            ValueError: invalid UTF-8, a wrong shape, a ``query`` of another length; a query
                that leaves the document too little room (module docstring).
        """
        parts = self.item_parts(inputs)
        ids = [p[0] for p in parts]
        if self.sharing is not None:
            costs = self.sharing.costs(ids, [int(p[1][0]) for p in parts])
        else:
            costs = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        return Priced(costs, prepared_array(parts))

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> RerankBatch:
        """The items' prompt ids (``inputs[PREPARED]``; tokenized here only where absent) on the
        device: after their shared prefixes (:func:`app.handlers.prefix_sharing.lay_out`), or
        padded whole in length groups where sharing is off.

        Raises:
            ValueError: as :meth:`item_costs`.
        """
        parts = self.item_parts(inputs)
        ids = [p[0] for p in parts]
        tokens = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        if self.sharing is None:
            groups, position = self.length_grouped(ids)
            return RerankBatch(groups, position, tokens)
        splits = [int(p[1][0]) for p in parts]
        layout = prefix_sharing.lay_out(
            self.sharing, ids, splits, self.cost.groups,
            lambda rows, indices: self.features(rows, indices=indices), self._device,
        )  # fmt: skip
        return RerankBatch(layout.groups, layout.position, tokens, layout.shared)

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
        if batch.shared is not None and self.sharing is not None:
            weight = self.model.get_output_embeddings().weight
            _, calls = self.sharing.run(batch.shared)
            scores += [yes_no_score_from_hidden(states.last(), weight, *self.yes_no) for states in calls]
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
