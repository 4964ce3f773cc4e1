"""Causal-LM scoring: each text's token log-likelihood under any causal LM folder (GPT-2, Llama,
Mistral, Qwen...), batched like the other text models.

``CausalLMHandler`` loads a folder with transformers' ``AutoModelForCausalLM`` (local files only)
and scores what the model would have predicted at each position of the text: the usual signal of
machine-written or low-quality posts (perplexity), and what evaluation harnesses compute from a
server (``app.protocols.completions``: OpenAI's legacy completions with ``echo`` and
``max_tokens = 0``).

Inputs (per item):

``text`` BYTES, required
    UTF-8 text to score.
``return_token_logprobs`` INT64 ``[1]``, optional
    1: fill the item's ``token_logprobs`` output; 0 (omitted): leave it empty; any other value
    is refused. Where the model does not declare it, ``token_logprobs`` is filled for every item.
``top_logprobs`` INT64 ``[1]``, optional
    0 to 20: the most likely tokens at each position to list beside the text's own (OpenAI's
    ``logprobs``; 20 is vLLM's default bound).
``next_token`` INT64 ``[1]``, optional
    1: list after the text's tokens the greedy next token (the most likely one after the text),
    its log-prob and alternatives, as OpenAI's completions with ``echo`` and ``max_tokens = 1``
    answer (what lm-evaluation-harness asks); 0 (omitted): not; it needs the item's
    ``token_logprobs``.
``truncate_prompt_tokens`` INT64 ``[1]``, optional
    vLLM's: keep the text's last k tokens (``app.handlers.text_config``).

Outputs (declare those you serve):

``log_likelihood`` FP32 ``[1]``
    Sum over the scored tokens of ``log p(token | tokens before)``, nats.
``mean_log_likelihood`` FP32 ``[1]``
    The sum over the scored tokens' count (0 where none is scored); its negation equals
    transformers' causal-LM ``loss`` on the same token ids.
``perplexity`` FP32 ``[1]``
    ``exp(-mean_log_likelihood)`` (1 where no token is scored).
``scored_tokens`` INT64 ``[1]``
    Tokens scored: every token after the first one the model ran.
``tokens`` INT64 ``[1]``
    Tokens of the text as the model reads it (special tokens and the scoring prefix included;
    a shared context counted in each text, however often it ran): ``usage``.
``windows`` INT64 ``[1]``
    1 (a text is one window: see ``truncation`` below).
``token_logprobs`` BYTES ``[1]``
    Where asked, JSON in OpenAI's legacy ``logprobs`` shape: ``tokens`` (each token of the text
    as the tokenizer decodes it alone), ``token_logprobs`` (null for the first token, which has
    no context), ``top_logprobs`` (per token, ``{token: logprob}`` of the token itself and the
    ``top_logprobs`` most likely, as OpenAI and vLLM list them: up to ``top_logprobs`` + 1
    entries, so that a token's log-prob equals the largest of its row exactly when it was the
    most likely; null for the first token; present where ``top_logprobs`` > 0) and
    ``text_offset`` (each token's offset in the concatenation of ``tokens``); with
    ``next_token``, one more entry in each for the greedy next token. Log-probs below -9999
    are written as -9999 (vLLM's stand-in for minus infinity, which JSON lacks). ``b""`` where
    not asked.

**The first token.** A causal LM scores a token from the tokens before it, so a text's first
token has none. Where the tokenizer puts a BOS token first (Llama, Mistral), every token of the
text is scored after it; elsewhere (GPT-2, Qwen) the handler puts the model's BOS token, else its
EOS token, before the text (``score_first_token = true``, the default: lm-evaluation-harness's
``prefix_token_id``), and that token is run, counted in ``tokens``, but not listed in
``token_logprobs``. ``score_first_token = false`` runs the text alone: its first token is not
scored (as OpenAI's legacy API and vLLM's prompt log-probs report it, null).

**One context, N continuations.** A request's texts that all begin with the same tokens (at
least :data:`app.handlers.prefix_sharing.MIN_FOUND_TOKENS`: the context of a multiple-choice
question sent once per choice, as lm-evaluation-harness sends it) have those tokens run once:
their keys and values computed once per batch (or taken from the prefix cache: the same context
in the next request), each text's own tokens run against them
(:mod:`app.handlers.prefix_sharing`). Nothing is declared: the common prefix is found from the
token ids. Every figure of each text (its log-likelihood, its per-token log-probs and
alternatives, the greedy next token) is the one it gets scored alone, within float rounding: the
context's own log-probs come from the context's forward, once.

``[parameters]``: those of :mod:`app.handlers.text_config` (``max_seq_length``: tokens per
text, default the tokenizer's ``model_max_length`` capped by the model's positions and 8,192),
``score_first_token`` (bool), ``truncation``: ``"truncate"`` (default: a longer text is
scored on its first ``max_seq_length`` tokens, ``scored_tokens`` says how many) or ``"error"``
(400), ``shared_prefix`` and ``prefix_cache_bytes`` (:mod:`app.handlers.prefix_sharing`).
Windows would score the tokens they repeat twice, so they are refused.

**Token lists are whole or refused.** A text whose ``token_logprobs`` are listed is never cut
by ``truncation``: over ``max_seq_length`` tokens it is refused (400 naming its tokens and the
limit), unless its ``truncate_prompt_tokens`` asks for its last tokens (then the list is theirs).
A list of a text's first tokens would read as the whole text's (``/v1/completions`` echoes the
prompt; lm-evaluation-harness indexes the list by its own token counts), as vLLM, which answers
such a prompt with a 400, knows.

**Memory.** The logits of a batch, ``[B, T, vocab]``, are never all made at once: the model's
last hidden state goes through its LM head in chunks of rows of at most 256 MiB of float32
logits, each reduced to its tokens' log-probs (:func:`app.handlers.decoder_math.token_log_likelihood`)
before the next is made. A model whose logits are not its LM head's alone (Gemma 2's final
soft-capping, Cohere's ``logit_scale``) runs its own forward and is reduced in the same chunks.

Source: transformers' ``ForCausalLMLoss`` (the reference the tests compare with),
lm-evaluation-harness (``loglikelihood_rolling``, ``prefix_token_id``), OpenAI's legacy
completions ``logprobs`` object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers import prefix_sharing
from app.handlers.decoder_math import LOG_SOFTMAX_CHUNK_BYTES, scoring_prefix, token_log_likelihood
from app.handlers.decoders import decoder_features, first_id, open_causal_lm, pad_decoder
from app.handlers.shared_prefix import common_prefix_length, pad_items
from app.handlers.text_base import TextHandler, prepared_parts
from app.handlers.text_config import (
    SHARED_PARAMETERS,
    ModelConfigLike,
    check_shared_parameters,
    declares_truncation,
    item_integers,
    text_inputs,
)
from app.handlers.tokenizing import Ids, Parts, TextTokenizer, Window, prepared_array
from app.models import windows as windowing
from app.models.base import Priced

__all__ = ["MAX_TOP_LOGPROBS", "CausalLMHandler", "ScoredBatch"]

_PARAMETERS = (*SHARED_PARAMETERS, "truncation", "score_first_token", *prefix_sharing.PARAMETERS)
#: The most alternatives per token (vLLM's default ``max_logprobs``; OpenAI's legacy API: 5).
MAX_TOP_LOGPROBS = 20
RETURN, TOP, NEXT = "return_token_logprobs", "top_logprobs", "next_token"
#: What a log-prob below it is written as (vLLM's stand-in for minus infinity: JSON has none).
LOGPROB_FLOOR = -9999.0
_NONE: Ids = np.zeros(0, dtype=np.int32)
#: One padded group's or one shared call's figures: ``(total [U], count [U], token_logprobs
#: [U, T], top_values [U, T, k], top_ids [U, T, k])`` (:meth:`CausalLMHandler._reduce`).
Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ScoredBatch:
    """``preprocess`` output: ``groups`` (the padded length groups on the device, right
    padding: the items run whole), ``position`` (int64 ``[B]``, each item's row in the groups'
    results then the shared calls', concatenated), and on the host each item's token ids ``ids``
    (the scoring prefix included), ``listed`` (bool ``[B]``: fill its ``token_logprobs``),
    ``top`` (int64 ``[B]``: alternatives per token) and ``next`` (bool ``[B]``: list the greedy
    next token too); ``shared``: the items run after a shared context (None: none)."""

    groups: list[dict[str, torch.Tensor]]
    position: torch.Tensor
    ids: list[Ids]
    listed: npt.NDArray[np.bool_]
    top: npt.NDArray[np.int64]
    next: npt.NDArray[np.bool_]
    shared: prefix_sharing.SharedRun | None = None


class CausalLMHandler(TextHandler):
    """Scores texts by their token log-likelihood (see the module docstring)."""

    kind = "CausalLMHandler"
    #: What runs after the layers, for the memory plan (``app.models.memory.declared_head``).
    MEMORY_HEAD = "lm-chunked"
    #: Whether the model keeps a prefix cache, for the memory plan (``app.models.memory``).
    MEMORY_PREFIX_CACHE = True

    def __init__(self) -> None:
        super().__init__()
        #: The LM head (a linear layer on the last hidden state); None: the model's own forward.
        self.head: Any = None
        #: Token ids put before each text (the scoring prefix), int32.
        self.prefix: Ids = _NONE
        #: Whether ``model.toml`` declares ``token_logprobs`` / ``return_token_logprobs``.
        self.lists = self.asks = False

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device`` (local files only), then
        measure the cost model (:meth:`TextHandler.calibrate`) unless ``model.toml`` fixes it.

        Raises:
            ValueError: unknown or bad parameters; ``truncation`` other than ``"truncate"`` or
                ``"error"``; a folder that is not a decoder's.
            FileNotFoundError: a missing folder.
        """
        parameters = dict(config.parameters)
        check_shared_parameters(config.name, self.kind, parameters, _PARAMETERS)
        first = parameters.get("score_first_token", True)
        if not isinstance(first, bool):
            raise ValueError(f"parameters.score_first_token must be true or false, got {first!r}")
        path, model, length = open_causal_lm(parameters, config.path, device, config.name)
        self.policy = windowing.WindowPolicy.from_parameters(
            parameters, length, default_truncation="truncate"
        )
        if self.policy.truncation not in ("truncate", "error"):
            raise ValueError(
                f'parameters.truncation must be "truncate" or "error" for a causal LM, got '
                f"{self.policy.truncation!r} (windows would score the tokens they repeat twice)"
            )
        self.truncates = declares_truncation(config)
        tokenizer = self._tokenizer_for(path, length, model.config, first)
        tokenizer.padding_side = "right"  # predict reads item b's values from the start of its row
        pad_decoder(tokenizer, path, model.config, config.name)
        self._tokenizer = tokenizer
        self.head = _lm_head(model)
        self.lists = any(spec.name == "token_logprobs" for spec in config.outputs)
        self.asks = any(spec.name == RETURN for spec in config.inputs)
        identity = (config.name, str(getattr(config, "version", "")))
        sharing = prefix_sharing.PrefixSharing.from_parameters(
            model, parameters, identity, config.name, sequence=True
        )
        self.sharing = sharing if self.head is not None else None  # it reads the head's logits
        self.set_device(device)
        self._model = model
        self.calibrate(parameters, lambda features: self._score(features, 0)[0])

    def _tokenizer_for(self, path: Any, length: int, hf_config: Any, first: bool) -> TextTokenizer:
        """The folder's tokenizer and :attr:`prefix`: a text's first token is scored after the
        tokenizer's BOS, else after the prefix, and the prefix leaves ``length - 1`` tokens."""
        stride = self.policy.overflow_stride
        tokenizer = TextTokenizer.from_folder(
            path, length, stride=stride, pairs=False, keeps_last=self.truncates
        )
        bos, eos = first_id(hf_config.bos_token_id), first_id(hf_config.eos_token_id)
        probe = tokenizer.encode(["a"])[0]
        prefix = scoring_prefix(bos, eos, adds_bos=bos is not None and len(probe) > 0 and probe[0] == bos)
        if not first or prefix is None:
            return tokenizer
        self.prefix = np.array([prefix], dtype=np.int32)
        return TextTokenizer.from_folder(
            path, length - 1, stride=stride, pairs=False, keeps_last=self.truncates
        )

    # --- per request ----------------------------------------------------------------------

    def window_queries(self, queries: Sequence[str] | None) -> None:
        """None: a causal LM scores a text alone."""
        return None

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """A text's ids as the model runs them (the scoring prefix, then the window's), and its
        split (0: a shared context is found per request, :meth:`item_costs`)."""
        ids = np.concatenate((self.prefix, window.ids)) if len(self.prefix) else window.ids
        return (ids, prefix_sharing.split_row(0))

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each text's ids (the scoring prefix first), truncated to ``max_seq_length``, or cut to
        its last ``keep`` tokens where asked."""
        cut = self.kept_windows(texts, None, keep)
        rest = [i for i in range(len(texts)) if i not in cut]
        encoded = dict(zip(rest, self.tokenizer.encode([texts[i] for i in rest]), strict=True))
        return [self.window_parts(cut[i], None) if i in cut else self.window_parts(_whole(encoded[i]), None)
                for i in range(len(texts))]  # fmt: skip

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """Tokens each item makes the model run, int64 ``[B]`` (the scoring prefix included; a
        shared context once, :meth:`app.handlers.prefix_sharing.PrefixSharing.costs`), with each
        item's ids and split (the context the request's texts share, module docstring) as its
        preparation.

        Raises:
            ValueError: invalid UTF-8, a wrong shape, ``top_logprobs`` outside 0 to 20,
                ``return_token_logprobs`` or ``next_token`` other than 0 or 1, ``next_token``
                without ``token_logprobs``; a text whose token log-probs are listed and that is
                longer than ``max_seq_length`` without ``truncate_prompt_tokens`` (module
                docstring).
        """
        priced = super().item_costs(inputs)
        listed, _, _ = self._options(inputs, len(priced.costs))
        self._check_whole(inputs, priced, listed)
        if self.sharing is None:
            return priced
        parts = self._found(list(priced.prepared))
        ids = [p[0] for p in parts]
        return Priced(self.sharing.costs(ids, [int(p[1][0]) for p in parts]), prepared_array(parts))

    def _found(self, parts: list[Parts]) -> list[Parts]:
        """``parts`` with their split set to the tokens they all begin with, where that is at
        least :data:`app.handlers.prefix_sharing.MIN_FOUND_TOKENS` (module docstring)."""
        split = common_prefix_length([p[0] for p in parts])
        if split < prefix_sharing.MIN_FOUND_TOKENS:
            return parts
        row = prefix_sharing.split_row(split)
        return [(p[0], row) for p in parts]

    def _check_whole(
        self, inputs: Mapping[str, npt.NDArray[Any]], priced: Priced, listed: npt.NDArray[np.bool_]
    ) -> None:
        """Refuse a listed item that the tokenizer cut (module docstring): only items whose ids
        reach the cap are counted again, whole."""
        cap = len(self.prefix) + self.tokenizer.max_length
        keep = self.keep(inputs, len(listed))
        suspects = [
            int(i) for i in np.flatnonzero(listed)
            if not (keep and keep[i]) and len(priced.prepared[i][0]) >= cap
        ]  # fmt: skip
        if not suspects:
            return
        texts, _ = text_inputs(inputs)
        for i, count in zip(suspects, self.tokenizer.whole_counts([texts[i] for i in suspects]), strict=True):
            if count > self.tokenizer.max_length:
                prefix = " (the scoring prefix included)" if len(self.prefix) else ""
                raise ValueError(
                    f"item {i} has {count + len(self.prefix)} tokens{prefix}, over the model's "
                    f"max_seq_length of {cap} tokens: a text's token log-probs are listed whole or "
                    "not at all; send a shorter text, or truncate_prompt_tokens to keep its last tokens"
                )

    def _options(
        self, inputs: Mapping[str, npt.NDArray[Any]], count: int
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Per item: whether its ``token_logprobs`` is filled, its ``top_logprobs``, and
        whether its greedy next token is listed (``next_token``).

        Raises:
            ValueError: a flag other than 0 or 1, ``top_logprobs`` out of range, ``next_token``
                without a list.
        """
        asked = _flag(inputs, RETURN, count)
        listed = np.full(count, self.lists and not self.asks) if asked is None else self.lists & asked
        top = item_integers(inputs, TOP, count)
        top = np.zeros(count, dtype=np.int64) if top is None else top
        if top.size and not 0 <= int(top.min()) <= int(top.max()) <= MAX_TOP_LOGPROBS:
            raise ValueError(f"{TOP} must be between 0 and {MAX_TOP_LOGPROBS}")
        following = _flag(inputs, NEXT, count)
        following = np.zeros(count, dtype=bool) if following is None else following
        if (following & ~listed).any():
            raise ValueError(
                f"{NEXT} = 1 lists the next token after the text's own: it needs the item's "
                f"token_logprobs ({RETURN} = 1, and a token_logprobs output)"
            )
        return listed, np.where(listed, top, 0), following

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> ScoredBatch:
        """Pad the items' token ids (``inputs[PREPARED]``; tokenized here only where absent) on
        the right, in length groups, on the device.

        Raises:
            ValueError: as :meth:`item_costs`.
        """
        parts = self.item_parts(inputs)
        listed, top, following = self._options(inputs, len(parts))
        if self.sharing is not None and prepared_parts(inputs) is None:
            parts = self._found(parts)  # tokenized here (warmup, a direct call): the batch's context
        ids = [p[0] for p in parts]
        splits = [int(p[1][0]) for p in parts]
        if self.sharing is None or not any(splits):
            groups, position = self.length_grouped(ids)
            return ScoredBatch(groups, position, ids, listed, top, following)
        layout = prefix_sharing.lay_out(
            self.sharing, ids, splits, self.cost.groups,
            lambda rows, indices: self.features(rows, indices=indices), self._device,
        )  # fmt: skip
        return ScoredBatch(layout.groups, layout.position, ids, listed, top, following, layout.shared)

    def _score(self, group: dict[str, torch.Tensor], top: int) -> Scored:
        """One padded group ``[U, T]``: ``(total [U], count [U], token_logprobs [U, T],
        top_values [U, T, top], top_ids [U, T, top])`` (float32; ``token_logprobs`` at t is
        token t's, from the logits at t - 1; the alternatives at t are those after token t,
        :func:`app.handlers.decoder_math.token_log_likelihood`), through the LM head in chunks
        of rows (module docstring)."""
        features = decoder_features(group)
        # the hidden state through the head chunk by chunk, or the model's own logits, chunked
        whole: torch.Tensor = (
            self.model.base_model(**features).last_hidden_state
            if self.head is not None
            else self.model(**features).logits
        )
        return self._reduce(whole, group["input_ids"], group["attention_mask"], top)

    def _reduce(self, whole: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, top: int) -> Scored:
        """:meth:`_score`'s figures of rows ``ids`` / ``mask`` (int64 ``[U, T]``) from their final
        hidden states (through the LM head) or their logits ``whole``, in chunks of rows."""
        rows, length = ids.shape
        vocab = int(self.model.config.get_text_config().vocab_size)
        step = max(1, LOG_SOFTMAX_CHUNK_BYTES // max(1, length * vocab * 4))
        parts: list[tuple[torch.Tensor, ...]] = []
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            logits = self.head(whole[start:stop]) if self.head is not None else whole[start:stop]
            scored = token_log_likelihood(logits, ids[start:stop], mask[start:stop], per_token=True, top=top)
            empty = torch.zeros((stop - start, length, 0), device=logits.device)
            values = scored.top_values if scored.top_values is not None else empty
            indices = scored.top_ids if scored.top_ids is not None else empty.long()
            assert scored.token_logprobs is not None
            parts.append((scored.total, scored.count, scored.token_logprobs, values, indices))
        total, count, logprobs, values, indices = (torch.cat(column) for column in zip(*parts, strict=True))
        return total, count, logprobs, values, indices

    def _score_shared(self, shared: prefix_sharing.SharedRun, top: int) -> list[Scored]:
        """Each shared call's items' figures as :meth:`_score` gives a whole text's: the contexts'
        own (their final hidden states through the head, once per distinct context) joined to
        each item's (its tokens after its context, the first scored from the context's last
        token), position for position (:func:`_joined`)."""
        assert self.sharing is not None
        states, calls = self.sharing.run(shared)
        ids, lengths = pad_items(shared.prefixes, self._device)
        hidden = states[0].hidden.new_zeros((len(states), ids.shape[1], states[0].hidden.shape[-1]))
        for g, state in enumerate(states):
            assert state.sequence is not None
            hidden[g, : state.length] = state.sequence
        mask = (torch.arange(ids.shape[1], device=ids.device) < lengths.unsqueeze(1)).long()
        context = self._reduce(hidden, ids, mask, top)
        out = []
        for call, items in zip(shared.calls, calls, strict=True):
            own = self._reduce(*items.with_context(), top)
            out.append(_joined(context, own, shared, call.items, ids.device))
        return out

    def predict(self, batch: ScoredBatch) -> dict[str, Any]:
        """Each item's figures on the device (float32 ``total``, ``count`` ``[B]``; with per-token
        lists, ``token_logprobs`` ``[B, T]`` and the alternatives ``[B, T, k]``, T the longest
        item), and the host's ``ids``, ``listed``, ``top``, ``next``."""
        top = int(batch.top.max()) if len(batch.top) else 0
        top = max(top, 1) if batch.next.any() else top  # the greedy next token is the first
        scored = [self._score(group, top) for group in batch.groups]
        if batch.shared is not None:
            scored += self._score_shared(batch.shared, top)
        width = max(int(s[2].shape[1]) for s in scored)
        columns = []
        for column in zip(*scored, strict=True):
            columns.append(torch.cat([_widen(c, width) for c in column])[batch.position])
        total, count, logprobs, values, indices = columns
        return {"total": total, "count": count, "logprobs": logprobs, "values": values, "indices": indices,
                "batch": batch}  # fmt: skip

    def postprocess(self, outputs: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
        """Host numpy arrays, ``[B, 1]`` each: FP32 ``log_likelihood``, ``mean_log_likelihood``,
        ``perplexity``; INT64 ``scored_tokens``, ``tokens``, ``windows``; BYTES
        ``token_logprobs`` (module docstring)."""
        batch: ScoredBatch = outputs["batch"]
        total = outputs["total"].to("cpu", torch.float32).numpy()
        count = outputs["count"].cpu().numpy().astype(np.int64)
        mean = np.where(count > 0, total / np.maximum(count, 1), 0.0).astype(np.float32)
        lists = np.empty((len(total), 1), dtype=object)
        lists[:] = b""
        if batch.listed.any():
            logprobs = outputs["logprobs"].cpu().numpy()
            values, indices = outputs["values"].cpu().numpy(), outputs["indices"].cpu().numpy()
            for i in np.flatnonzero(batch.listed):
                lists[i, 0] = self._listed(
                    batch.ids[i], logprobs[i], values[i], indices[i], int(batch.top[i]), bool(batch.next[i])
                )
        return {
            "log_likelihood": total.reshape(-1, 1),
            "mean_log_likelihood": mean.reshape(-1, 1),
            "perplexity": np.exp(-mean).astype(np.float32).reshape(-1, 1),
            "scored_tokens": count.reshape(-1, 1),
            "tokens": np.array([len(ids) for ids in batch.ids], dtype=np.int64).reshape(-1, 1),
            "windows": np.ones((len(total), 1), dtype=np.int64),
            "token_logprobs": lists,
        }

    def _listed(
        self,
        ids: Ids,
        logprobs: npt.NDArray[np.float32],
        values: npt.NDArray[np.float32],
        indices: npt.NDArray[np.int64],
        top: int,
        following: bool,
    ) -> bytes:
        """One item's ``token_logprobs`` JSON (module docstring): its tokens after the prefix,
        and the greedy next token where ``following``. ``values``/``indices`` at position p are
        the alternatives after token p."""
        import orjson

        skip, last = len(self.prefix), len(ids) - 1
        own = [int(t) for t in ids[skip:]]
        if following:
            own.append(int(indices[last, 0]))
        texts = self.tokenizer.token_texts(own)
        # the token at position p (p >= 1) has the log-prob the logits at p - 1 give it
        scores: list[float | None] = [
            None if skip + t == 0 else _floor(logprobs[skip + t]) for t in range(len(own) - following)
        ]
        if following:
            scores.append(_floor(values[last, 0]))
        body: dict[str, Any] = {"tokens": texts, "token_logprobs": scores}
        if top:
            names = self.tokenizer.token_texts(indices[: last + 1, :top].reshape(-1).tolist())
            rows: list[dict[str, float] | None] = []
            for t, score in enumerate(scores):
                before = skip + t - 1  # the position whose logits chose this token
                if score is None:
                    rows.append(None)
                    continue
                # the most likely first, then the token itself; tokens that decode to the same
                # text (byte pieces of a character) keep the larger log-prob, so the row's largest
                # is the most likely token's and equals the token's own only where it is that one
                row: dict[str, float] = {}
                for j in range(top):
                    row.setdefault(names[before * top + j], _floor(values[before, j]))
                row.setdefault(texts[t], score)
                rows.append(row)
            body["top_logprobs"] = rows
        body["text_offset"] = np.cumsum([0, *(len(s) for s in texts)])[:-1].astype(int).tolist()
        return orjson.dumps(body)


def _flag(inputs: Mapping[str, npt.NDArray[Any]], name: str, count: int) -> npt.NDArray[np.bool_] | None:
    """An optional INT64 0/1 input per item as bools (None where absent).

    Raises:
        ValueError: a value other than 0 or 1.
    """
    values = item_integers(inputs, name, count)
    if values is None:
        return None
    bad = values[(values != 0) & (values != 1)]
    if bad.size:
        raise ValueError(f"{name} must be 0 or 1, got {int(bad[0])}")
    flags: npt.NDArray[np.bool_] = values == 1
    return flags


def _floor(value: Any) -> float:
    """A log-prob as JSON can hold it (module docstring: :data:`LOGPROB_FLOOR`)."""
    return max(float(value), LOGPROB_FLOOR)


def _joined(
    context: Scored,
    own: Scored,
    shared: prefix_sharing.SharedRun,
    items: npt.NDArray[np.int64],
    device: torch.device,
) -> Scored:
    """One shared call's figures for its ``items`` (indices into ``shared``) as whole texts':
    their context's ``context`` (per distinct context, ``[G, P]``) and their own ``own`` (``[n,
    T + 1]``, position 0 the context's last token) side by side. Item b of context length P:
    token log-probs at positions ``< P`` are its context's, position ``P + t`` its token t's
    (``own`` at t + 1); the alternatives after positions ``< P - 1`` are its context's, after
    position ``P - 1 + t`` its own at t; totals and counts add up."""
    owner = torch.as_tensor(shared.owner[items], device=device)
    split = torch.as_tensor(shared.splits[items], device=device).unsqueeze(1)
    width = int((shared.splits[items] + shared.lengths[items]).max())
    at = torch.arange(width, device=device).unsqueeze(0).expand(len(items), width)
    in_context = at.clamp(max=context[2].shape[1] - 1)
    in_own = (at - split + 1).clamp(0, own[2].shape[1] - 1)
    ends = (at < split + torch.as_tensor(shared.lengths[items], device=device).unsqueeze(1)).float()
    logprobs = (
        torch.where(at < split, context[2][owner].gather(1, in_context), own[2].gather(1, in_own)) * ends
    )

    def alternatives(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        k = before.shape[-1]
        first = before[owner].gather(1, in_context.unsqueeze(2).expand(-1, -1, k))
        then = after.gather(1, in_own.unsqueeze(2).expand(-1, -1, k))
        return torch.where((at < split - 1).unsqueeze(2), first, then)

    total = context[0][owner] + own[0]
    count = context[1][owner] + own[1]
    return total, count, logprobs, alternatives(context[3], own[3]), alternatives(context[4], own[4])


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """A group's per-position values ``[U, T, ...]`` padded with zeros to ``width`` positions
    (per-row values ``[U]`` as they are)."""
    if values.dim() < 2:
        return values
    return torch.nn.functional.pad(values, (0, 0) * (values.dim() - 2) + (0, width - values.shape[1]))


def _whole(ids: Ids) -> Window:
    return Window(0, 0, len(ids), ids)


def _lm_head(model: Any) -> Any:
    """The model's LM head where its logits are the head's alone (a linear layer on the last
    hidden state); None where the model scales or caps them (module docstring)."""
    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    if not isinstance(head, torch.nn.Linear) or any(
        getattr(text, key, None) not in (None, 1.0) for key in ("final_logit_softcapping", "logit_scale")
    ):
        return None
    return head
