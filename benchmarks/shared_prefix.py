"""Shared-prefix scoring in process: one prefix (a user, a query) x N items (candidates) through
a Qwen3-class causal LM, with and without sharing the prefix, with the prefix cache warm.

    python -m benchmarks.shared_prefix
    python -m benchmarks.shared_prefix --items 20,100 --prefix 256 --requests 2 --out out/shared-prefix.json
    python -m benchmarks.shared_prefix --device cuda --dtype bfloat16 --out out/shared-prefix-gpu.json

The model: ``Qwen3ForCausalLM`` built from a config (``--hidden`` 384, ``--layers`` 6, 6 query
heads over 2 key/value heads of 64, MLP 4 x hidden, a vocabulary of 32,000 tied to the
embeddings: about 25 M parameters; the count is printed), random weights from a fixed seed,
``sdpa`` attention; no server. A request is one prefix of ``--prefix`` random tokens and N items
of 16 to 64 (``--item-tokens``) random tokens; the server's batches are ``--batch`` items, so a
request of N items runs in ``ceil(N / batch)`` batches, each scored as a handler's ``predict``
would score it (``--score``: ``last``, the reranker's yes/no logit from the hidden state at
each item's last token; ``logprobs``, the causal-LM scorer's log-likelihood of each item's tokens
through the LM head):

- **none**: today's way: each item is ``prefix + item``, a batch right-padded to its longest,
  position ids from the mask (``app.handlers.decoders.decoder_features``);
- **expand**: per batch, the prefix run once (``encode_prefixes``), the items against its keys
  and values expanded over the batch (``run_items``), one item a row, right-padded
  (``item_rows(pack=False)``);
- **binned**: **expand** with several items to a row where they fit in the longest item's length
  (``item_rows``: best fit, each item masked from the others in its row): less padding;
- **packed**: per batch, one sequence ``prefix + item_1 + ... + item_n`` with a block mask
  (``run_packed``: SGLang's multi-item scoring); left out where its ``L x L`` mask would pass
  ``--max-mask-mib``;
- **cached**: **binned** with the prefix's state from a warm prefix cache (the next page of the
  same feed: the same prefix, new items): only the items run.

Columns: **items/s** (N x requests over their total time), **p50 ms** (per request), **CPU ms**
(the process's CPU time per request, median: the figure to compare on a machine shared with
other work, with ``--threads 1``), **x none** (items/s over **none**'s), **tokens run** (per
request, padding included), **max abs Δ** (the largest difference of an item's score from
**none**'s: exactness). Each configuration runs one request untimed first, then ``--requests``
timed ones, each with new items (and, but for **cached**, a new prefix). Torch's threads: its
default, or ``--threads``.

**Through a real server** (``--server``): the causal reranker as it is served, one gunicorn
worker on 127.0.0.1 with two models of the same folder (the Qwen3 model above, ``--hidden`` and
``--layers``, saved with a Qwen3-style tokenizer trained locally and the reranker's prompt tokens):
``reranker`` (shared prefixes, the prefix cache on) and ``reranker-whole`` (``shared_prefix =
false``, ``prefix_cache_bytes = 0``: each document with its whole prompt, as before). A request is
one query of ``--prefix`` tokens x N documents of ``--item-tokens`` tokens (words that are one
token each), over ``--route`` (``rerank``: ``/v1/rerank``; ``score``: ``/score`` with one
``text_1``), sent one after another. Per N, the modes:

- **whole**: ``reranker-whole``, a new query each request (today's way);
- **shared**: ``reranker``, a new query each request (the query run once, not yet cached);
- **cached**: ``reranker``, the query of the request before with new documents (the next page
  of the same feed: the query's keys and values from the prefix cache).

Each mode runs one request untimed first, then ``--requests`` timed. Columns: **docs/s** (N x
requests over their time), **p50 ms** (per request), **x whole** (docs/s over **whole**'s), **max
abs Δ** (the largest difference of a score from **whole**'s on the same request: exactness; the
scores are the reranker's yes/no probabilities, which random weights squash towards 0 or 1).

    python -m benchmarks.shared_prefix --server --items 20,100,500 --prefix 256 --item-tokens 32 \
        --requests 3 --out docs/benchmarks/shared-prefix-server-cpu.json
    python -m benchmarks.shared_prefix --server --items 20 --requests 2   # a quick look

Writes the JSON record (``--out``) and a Markdown table beside it; prints the table. Speed
figures need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers.decoder_math import last_token_pool, token_log_likelihood
from app.handlers.decoders import decoder_features
from app.handlers.prefix_cache import PrefixCache
from app.handlers.shared_prefix import (
    ItemStates,
    encode_prefixes,
    item_log_likelihood,
    item_rows,
    pad_items,
    run_items,
    run_packed,
)
from app.models.memory import safetensors_parameters
from benchmarks import driver, report, server

MODES = ("none", "expand", "binned", "packed", "cached")
YES, NO = 9693, 2152  # two rows of the LM head, as a reranker's "yes" and "no"


def build_model(hidden: int, layers: int, device: str, dtype: torch.dtype) -> Any:
    """A Qwen3 causal LM of random weights (seed 0): ``hidden`` wide, ``layers`` deep, heads of
    64 (hidden / 64 query heads over a third as many key/value heads, at least 1), MLP 4 x
    hidden, 32,000 tokens, tied embeddings, ``sdpa``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, hidden // 64)
    config = Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class Request:
    """One request: its prefix and items (token ids, int64)."""

    prefix: npt.NDArray[np.int64]
    items: list[npt.NDArray[np.int64]]


def requests(count: int, items: int, prefix: int, low: int, high: int, seed: int) -> list[Request]:
    """``count`` requests of random tokens (ids 1 to 31,999)."""
    rng = np.random.default_rng(seed)
    return [
        Request(
            rng.integers(1, 32000, size=prefix),
            [rng.integers(1, 32000, size=int(n)) for n in rng.integers(low, high + 1, size=items)],
        )
        for _ in range(count)
    ]


class Scorer:
    """The ways of :data:`MODES`, each ``(request) -> (scores float32 [N], tokens run)``."""

    def __init__(self, model: Any, score: str, batch: int) -> None:
        self.model, self.base, self.score, self.batch = model, model.base_model, score, batch
        self.head = model.get_output_embeddings()
        self.cache = PrefixCache(2**40)
        self.device = next(model.parameters()).device

    def _yes_no(self, last: torch.Tensor) -> torch.Tensor:
        """The reranker's logit ``h . (W[yes] - W[no])``, float32 ``[n]`` (the sigmoid left out:
        random weights saturate it, and the differences between ways would not show)."""
        weight: torch.Tensor = self.head.weight
        return last.float() @ (weight[YES].float() - weight[NO].float())

    def _batches(self, items: Sequence[npt.NDArray[np.int64]]) -> list[Sequence[npt.NDArray[np.int64]]]:
        return [items[i : i + self.batch] for i in range(0, len(items), self.batch)]

    def _from_states(self, states: ItemStates) -> torch.Tensor:
        if self.score == "last":
            return self._yes_no(states.last())
        return item_log_likelihood(self.head, states).total

    @torch.inference_mode()
    def none(self, request: Request) -> tuple[torch.Tensor, int]:
        scores, tokens = [], 0
        for chunk in self._batches(request.items):
            ids, lengths = pad_items([np.concatenate((request.prefix, item)) for item in chunk], self.device)
            mask = (torch.arange(ids.shape[1], device=self.device) < lengths.unsqueeze(1)).long()
            features = decoder_features({"input_ids": ids, "attention_mask": mask})
            hidden = self.base(**features).last_hidden_state
            tokens += ids.numel()
            if self.score == "last":
                scores.append(self._yes_no(last_token_pool(hidden, mask)))
            else:
                # the item's tokens only: those after the prefix's first len(prefix) - 1 tokens
                start = len(request.prefix) - 1
                scored = mask.clone()
                scored[:, :start] = 0
                scores.append(
                    token_log_likelihood(
                        self.head(hidden[:, start:]), ids[:, start:], scored[:, start:]
                    ).total
                )
        return torch.cat(scores), tokens

    def _expand(self, request: Request, pack: bool, cache: PrefixCache | None) -> tuple[torch.Tensor, int]:
        scores, tokens = [], 0
        for chunk in self._batches(request.items):
            if cache is None:
                states = encode_prefixes(self.base, [request.prefix])
                tokens += len(request.prefix)
            else:
                before = cache.stats().miss_tokens
                states = cache.states("bench", [request.prefix], lambda new: encode_prefixes(self.base, new))
                tokens += cache.stats().miss_tokens - before
            rows = item_rows(chunk, pack=pack, device=self.device)
            scores.append(self._from_states(run_items(self.base, states, rows)))
            tokens += rows.tokens
        return torch.cat(scores), tokens

    @torch.inference_mode()
    def expand(self, request: Request) -> tuple[torch.Tensor, int]:
        return self._expand(request, pack=False, cache=None)

    @torch.inference_mode()
    def binned(self, request: Request) -> tuple[torch.Tensor, int]:
        return self._expand(request, pack=True, cache=None)

    @torch.inference_mode()
    def packed(self, request: Request) -> tuple[torch.Tensor, int]:
        scores, tokens = [], 0
        for chunk in self._batches(request.items):
            scores.append(self._from_states(run_packed(self.base, [request.prefix], chunk, [0] * len(chunk))))
            tokens += len(request.prefix) + sum(len(i) for i in chunk)
        return torch.cat(scores), tokens

    @torch.inference_mode()
    def cached(self, request: Request) -> tuple[torch.Tensor, int]:
        return self._expand(request, pack=True, cache=self.cache)


def packed_mask_mib(request: Request, batch: int) -> float:
    """The largest block mask :func:`run_packed` makes for ``request`` in batches of ``batch``
    (float32 ``L x L``), MiB."""
    longest = max(
        len(request.prefix) + sum(len(i) for i in request.items[s : s + batch])
        for s in range(0, len(request.items), batch)
    )
    return longest * longest * 4 / 2**20


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    scorer: Scorer, mode: str, work: list[Request], reference: dict[int, torch.Tensor] | None
) -> dict[str, Any]:
    """One configuration: ``work[0]`` untimed (for **cached**: it warms the cache), then the
    others timed; for **cached** each timed request reuses the prefix of the one before."""
    run: Callable[[Request], tuple[torch.Tensor, int]] = getattr(scorer, mode)
    scorer.cache.clear()
    run(work[0])
    seconds, cpu, tokens, delta = [], [], [], 0.0
    for index, request in enumerate(work[1:], start=1):
        if mode == "cached":
            request = Request(work[0].prefix, request.items)
        synchronize(scorer.device)
        start, start_cpu = time.perf_counter(), time.process_time()
        scores, ran = run(request)
        synchronize(scorer.device)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        tokens.append(ran)
        if reference is not None:
            expected = reference.get(index)
            if mode == "none":
                reference[index] = scores
            elif expected is not None and mode != "cached":
                delta = max(delta, float((scores - expected).abs().max()))
    items = sum(len(r.items) for r in work[1:])
    return {
        "items_per_s": items / sum(seconds),
        "p50_ms": 1000 * statistics.median(seconds),
        "cpu_ms": 1000 * statistics.median(cpu),
        "tokens_run": statistics.median(tokens),
        "max_delta": delta if reference is not None and mode not in ("none", "cached") else None,
    }


# --- through a real server -------------------------------------------------------------------

SERVER_MODES = ("whole", "shared", "cached")
RERANKER = "app.handlers.causal_rerank:CausalRerankHandler"


def reranker_folder(path: Path, hidden: int, layers: int) -> Path:
    """A causal reranker's folder at ``path``: :func:`build_model`'s Qwen3 (its vocabulary of
    32,000 rows, more than the tokenizer uses) with a Qwen3-style byte-level BPE tokenizer
    trained here (``tests.support.decoder_models``: ``yes``, ``no`` and the prompt's special
    tokens among its tokens), left padding as Qwen3-Reranker's."""
    from transformers import PreTrainedTokenizerFast

    from tests.support.decoder_models import train_tokenizer

    tokenizer, names = train_tokenizer("qwen3")
    model = build_model(hidden, layers, "cpu", torch.float32)
    model.config.eos_token_id = tokenizer.token_to_id(names["eos_token"])
    model.save_pretrained(path)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=4096, padding_side="left", **names
    ).save_pretrained(path)
    return path


def write_repository(repo: Path, folder: Path, batch: int) -> None:
    """``reranker`` and ``reranker-whole`` (module docstring) serving ``folder``: batches of up
    to ``batch`` documents, prompts of up to 1,024 tokens, deadlines of up to 10 minutes (a
    request of 500 whole prompts takes over a minute on a CPU)."""
    whole = "shared_prefix = false\nprefix_cache_bytes = 0"
    for name, extra in (("reranker", ""), ("reranker-whole", whole)):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(
            f'name = "{name}"\nversion = "1"\nformat = "handler"\nhandler = "{RERANKER}"\n'
            f"max_batch_size = {batch}\nmax_queue_delay_ms = 2.0\nwarmup_batch_sizes = [1, {batch}]\n"
            "max_timeout_ms = 600000.0\n"
            '[[inputs]]\nname = "text"\ndatatype = "BYTES"\nshape = [1]\n'
            '[[inputs]]\nname = "query"\ndatatype = "BYTES"\nshape = [1]\n'
            '[[outputs]]\nname = "score"\ndatatype = "FP32"\nshape = [1]\n'
            '[[outputs]]\nname = "tokens"\ndatatype = "INT64"\nshape = [1]\n'
            f'[parameters]\nmodel_dir = "{folder}"\nmax_seq_length = 1024\n{extra}\n'
        )


class Words:
    """Texts of an exact number of tokens of ``folder``'s tokenizer: words each one token after a
    space (``" word"``), drawn at random."""

    def __init__(self, folder: Path, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = self.tokenizer.get_vocab()
        candidates = sorted(t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3)
        self.words = [
            w for w in candidates if len(self.tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1
        ]
        self.rng = np.random.default_rng(seed)

    def text(self, tokens: int) -> str:
        """A text whose ``" " + text`` is ``tokens`` tokens (as the reranker tokenizes a document)."""
        return " ".join(self.rng.choice(self.words, size=tokens).tolist())


def server_body(route: str, model: str, query: str, documents: list[str]) -> dict[str, Any]:
    if route == "score":
        return {"model": model, "text_1": query, "text_2": documents}
    return {"model": model, "query": query, "documents": documents}


def server_scores(route: str, body: Any) -> npt.NDArray[np.float64]:
    """The documents' scores in their order, from a ``/v1/rerank`` or ``/score`` answer."""
    rows = body["results"] if route == "rerank" else body["data"]
    key = "relevance_score" if route == "rerank" else "score"
    return np.array([r[key] for r in sorted(rows, key=lambda r: r["index"])])


#: Each request's deadline (the repository's ``max_timeout_ms``).
DEADLINE = {"X-Request-Timeout-Ms": "600000"}


def server_mode(
    url: str, route: str, mode: str, items: int, work: list[tuple[str, list[str]]]
) -> tuple[dict[str, Any], list[npt.NDArray[np.float64]]]:
    """One mode of :data:`SERVER_MODES` (module docstring) over ``work`` (queries and their
    documents; the first untimed): docs/s, p50, and each timed request's scores."""
    model = "reranker-whole" if mode == "whole" else "reranker"
    path = "/v1/rerank" if route == "rerank" else "/score"
    seconds, scores = [], []
    for index, (query, documents) in enumerate(work):
        if mode == "cached" and index:
            query = work[0][0]  # the query of the request before: its prefix is cached
        start = time.perf_counter()
        body = server_body(route, model, query, documents)
        status, _, body = driver.http("POST", url + path, body, DEADLINE, timeout=600)
        took = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"{model}: {status} {body}")
        if index:
            seconds.append(took)
            scores.append(server_scores(route, body))
    figures = {"docs_per_s": items * len(seconds) / sum(seconds), "p50_ms": 1000 * statistics.median(seconds)}
    return figures, scores


def run_server(args: argparse.Namespace) -> None:
    """``--server`` (module docstring)."""

    query_tokens = args.prefix[0]
    document_tokens = args.item_tokens[0]
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = reranker_folder(root / "hf", args.hidden, args.layers)
        parameters = safetensors_parameters(folder) or 0
        write_repository(root / "repo", folder, args.batch)
        words = Words(folder, seed=0)
        with server.start(root, root / "repo", "", 1) as srv:
            srv.wait_ready(600)
            for items in args.items:
                work = [
                    (words.text(query_tokens), [words.text(document_tokens) for _ in range(items)])
                    for _ in range(args.requests + 1)
                ]
                baseline: dict[str, Any] = {}
                reference: list[npt.NDArray[np.float64]] = []
                for mode in SERVER_MODES:
                    figures, scores = server_mode(srv.url, args.route, mode, items, work)
                    if mode == "whole":
                        baseline, reference = figures, scores
                    delta = (
                        max(float(np.abs(a - b).max()) for a, b in zip(scores, reference, strict=True))
                        if mode == "shared" else None
                    )  # fmt: skip
                    records.append({"items": items, "mode": mode, **figures, "max_delta": delta})
                    rows.append([
                        items, mode, f"{figures['docs_per_s']:.1f}", f"{figures['p50_ms']:.0f}",
                        f"{figures['docs_per_s'] / baseline['docs_per_s']:.2f}",
                        "-" if delta is None else f"{delta:.1e}",
                    ])  # fmt: skip
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
            metrics = [line for line in srv.scrape().splitlines() if line.startswith("scoring_prefix_cache_")]
    caption = (
        f"Causal reranker served (one worker, {args.route}), Qwen3 of {parameters / 1e6:.1f} M parameters "
        f"({args.layers} layers, hidden {args.hidden}, float32, random weights), 1 query of {query_tokens} "
        f"tokens x N documents of {document_tokens}, batches of {args.batch}, {args.requests} timed requests "
        f"each; {report.machine_label()}"
    )
    tables = caption + "\n\n" + report.table(
        ["N", "mode", "docs/s", "p50 ms", "x whole", "max abs Δ"], rows, "rlrrrr"
    )
    result = report.record(
        parameters=parameters, arguments={k: str(v) for k, v in vars(args).items()}, runs=records,
        prefix_cache_metrics=metrics,
    )  # fmt: skip
    if args.out is not None:
        report.publish(args.out, result, tables)
    else:
        print(tables)
        print(json.dumps(metrics, indent=1))


def _modes(text: str) -> list[str]:
    chosen = [m for m in text.split(",") if m]
    if not chosen or set(chosen) - set(MODES):
        raise argparse.ArgumentTypeError(f"choose from {','.join(MODES)}, got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--items", type=server.levels, default=[20, 100, 500], help="items per request (N), comma-separated"
    )
    ints = server.levels  # comma-separated positive whole numbers
    parser.add_argument("--prefix", type=ints, default=[64, 256, 512], help="prefix tokens, comma-separated")
    parser.add_argument("--item-tokens", type=ints, default=[16, 64], help="an item's tokens: low,high")
    parser.add_argument("--batch", type=int, default=64, help="items per batch (the model's max_batch_size)")
    parser.add_argument("--requests", type=int, default=3, help="timed requests per configuration")
    parser.add_argument("--modes", type=_modes, default=list(MODES), help=f"of {','.join(MODES)}")
    parser.add_argument("--score", choices=("last", "logprobs"), default="last")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--max-mask-mib", type=float, default=1024.0, help="packed: the largest mask run")
    parser.add_argument("--out", type=Path, default=None, help="JSON record (and .md table beside it)")
    parser.add_argument("--server", action="store_true", help="through a real server (module docstring)")
    parser.add_argument("--route", choices=("rerank", "score"), default="rerank", help="--server: the route")
    args = parser.parse_args(argv)
    if args.server:
        if argv is None or "--prefix" not in argv:
            args.prefix = [256]
        if argv is None or "--item-tokens" not in argv:
            args.item_tokens = [32]
        run_server(args)
        return
    low, high = (args.item_tokens * 2)[:2]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.hidden, args.layers, args.device, getattr(torch, args.dtype))
    parameters = sum(p.numel() for p in model.parameters())
    scorer = Scorer(model, args.score, args.batch)
    rows, records = [], []
    for items in args.items:
        for prefix in args.prefix:
            work = requests(args.requests + 1, items, prefix, low, high, seed=items * 7919 + prefix)
            reference: dict[int, torch.Tensor] = {}
            baseline = None
            for mode in args.modes:
                if mode == "packed" and packed_mask_mib(work[0], args.batch) > args.max_mask_mib:
                    rows.append([items, prefix, mode, "-", "-", "-", "-", "-", "mask too large"])
                    continue
                figures = measure(scorer, mode, work, reference if "none" in args.modes else None)
                baseline = figures["items_per_s"] if mode == "none" else baseline
                records.append({"items": items, "prefix": prefix, "mode": mode, **figures})
                speedup = f"{figures['items_per_s'] / baseline:.2f}" if baseline else "-"
                delta = figures["max_delta"]
                shown = "-" if delta is None or math.isnan(delta) else f"{delta:.1e}"
                rows.append([
                    items, prefix, mode, f"{figures['items_per_s']:.1f}", f"{figures['p50_ms']:.1f}",
                    f"{figures['cpu_ms']:.1f}", speedup, f"{figures['tokens_run']:.0f}", shown,
                ])  # fmt: skip
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
    caption = (
        f"Qwen3 causal LM, {parameters / 1e6:.1f} M parameters ({args.layers} layers, hidden {args.hidden}, "
        f"{args.dtype}, {args.device}), score {args.score}, items of {low}-{high} tokens, batches of "
        f"{args.batch}, {args.requests} timed requests each; {report.machine_label()}"
    )
    header = ["N", "prefix", "mode", "items/s", "p50 ms", "CPU ms", "x none", "tokens run", "max abs Δ"]
    tables = caption + "\n\n" + report.table(header, rows, "rrlrrrrrr")
    result = report.record(
        parameters=parameters, arguments={k: str(v) for k, v in vars(args).items()}, runs=records
    )
    if args.out is not None:
        report.publish(args.out, result, tables)
    else:
        print(tables)


if __name__ == "__main__":
    main()
