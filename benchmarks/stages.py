"""Where a worker's CPU goes, by stage of the request path: py-spy's samples of the worker mapped
to stages, and the worker's measured CPU shared out among them. The one place that says which
code is which stage (:data:`RULES`); :mod:`benchmarks.host_path` uses it.

A sample is one stack of one thread that was not idle (py-spy's default: threads waiting in the
kernel are left out), read from ``py-spy record --threads --format raw`` (collapsed stacks:
``thread (tid): name;frame;...;leaf count``, each frame ``function (path:line)``, paths relative
to their ``sys.path`` entry). Its stage is that of its **leaf-most frame that a rule names**: frames of
libraries that serve every stage (numpy, the standard library's ``json``... where no rule names
them) fall through to the caller that used them, so ``numpy.asarray`` called by a decoder counts
as decoding. A stack no rule names is ``other``. Code that runs in C without a Python frame of its
own (msgspec, orjson, the Rust tokenizer, protobuf's upb) counts as the Python function that
called it, which is why our own functions are matched by name as well as by file.

**CPU, not samples.** A thread that is runnable but waiting for a core is "not idle" to py-spy,
so on a busy machine sample counts overstate the threads that wait most. A thread woken from its
wait for work (an inference thread's queue, a thread pool's) that then waits for the GIL is
"not idle" too, though it runs nothing: those samples (their leaf one of :data:`WAITS`) count
as ``waiting`` and get none of the thread's CPU (the wake-up's kernel time is the thread's
system CPU, which the samples of its work share). The CPU is therefore
shared out per thread (:func:`cpu_by_stage`): each thread's own CPU seconds over the window
(``/proc/<pid>/task/<tid>``, psutil) among the stages of its own samples. A thread that used CPU
but has no Python sample counts by its name (:data:`THREAD_STAGES`: gRPC core's threads are
the edge), else as ``native``: threads that run no Python, such as the ``tokenizers`` Rust pool
that ``encode_batch`` starts (one thread per core, all named like the process), so on the text
path ``native`` is tokenizing work.

The stages (:data:`STAGES`) are those of issue 48's profile: the edge (aiohttp, gRPC, the event
loop, our HTTP middleware and listener), decoding, validation, the item stage (windows, the
response cache), admission/queue/batching (and the inference threads' hand-offs), tokenizing,
the forward (torch, ONNX Runtime, the model code of transformers), pre/postprocessing (tensors
into and out of the model), response encoding, metrics (and tracing).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Stage key -> what it covers, in the order tables list them.
STAGES: dict[str, str] = {
    "edge": "aiohttp / gRPC / event loop / edge middleware",
    "decode": "JSON / protobuf decode",
    "validation": "validation",
    "items": "item stage / windows",
    "batching": "admission / queue / batching",
    "tokenizing": "tokenizing",
    "forward": "forward (torch / ONNX Runtime)",
    "postprocess": "pre/postprocess",
    "encode": "response encoding",
    "metrics": "metrics / tracing",
    "native": "threads without Python frames (tokenizer pool)",
    "other": "other",
}

#: Our functions (any module of ``app/``) by what their name says they do.
_DECODE = (
    r"decode|deserializ|parse|to_array|typed_array|contents_to_array|split_body|check_json_depth"
    r"|_brackets|_deepest|input_texts|infer_request|text_input"
)
_ENCODE = r"encode|serializ|tensor_bytes|build_response|response_document|attach_binary|_fill_contents|dumps"
_TOKENIZE = r"tokeniz|encodings?\b|encode_batch|item_costs|batch_cost|price|preprocess"
_VALIDATE = r"validat|check_(shape|elements|against|items)|complete_inputs|requested_outputs|items_within"


@dataclass(frozen=True)
class Rule:
    """Frames whose path matches ``path`` (and, when given, whose function matches ``function``:
    ``re.search`` on the qualified name, e.g. ``DataPlane.infer``) are ``stage``."""

    stage: str
    path: str
    function: str | None = None

    def matches(self, function: str, path: str) -> bool:
        if not re.search(self.path, path):
            return False
        return self.function is None or re.search(self.function, function) is not None


#: The first rule that names a frame gives its stage (module docstring).
RULES: tuple[Rule, ...] = (
    # libraries
    Rule("metrics", r"^(prometheus_client|opentelemetry)/"),
    Rule("tokenizing", r"^tokenizers/|^transformers/(models/[^/]+/)?tokenization"),
    Rule("tokenizing", r"^sentence_transformers/", r"tokeniz"),
    Rule("forward", r"^(torch|onnxruntime|transformers|sentence_transformers|safetensors)/"),
    Rule("decode", r"^json/decoder|^google/protobuf/"),
    Rule("encode", r"^json/encoder"),
    Rule("edge", r"^(aiohttp|multidict|yarl|uvloop|gunicorn)/|^asyncio/|^selectors|^ssl|(^|/)grpc/|_cygrpc"),
    Rule("batching", r"^threading|^concurrent/futures/|^queue"),
    # ours
    Rule("metrics", r"^app/observability/"),
    Rule("items", r"^app/serving/(items|windows|item_cache|response_cache|redis_tier)\.py"),
    Rule("items", r"^app/handlers/windows"),
    Rule("tokenizing", r"^app/handlers/tokenizing\.py"),
    Rule("tokenizing", r"^app/handlers/", _TOKENIZE),
    Rule("forward", r"^app/(handlers|models)/", r"predict|forward|replay|run_graph|__call__"),
    Rule("postprocess", r"^app/(handlers|models)/"),
    Rule("encode", r"^app/", _ENCODE),
    Rule("decode", r"^app/", _DECODE),
    Rule("validation", r"^app/(serving|protocols|grpc)/", _VALIDATE),
    Rule("postprocess", r"^app/serving/executor", r"preprocess|postprocess|finish"),
    Rule("batching", r"^app/serving/|^app/server/(router|siblings|peers)"),
    Rule("decode", r"^app/protocols/"),
    Rule("edge", r"^app/(http|grpc|server)/"),
)  # fmt: skip

_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")

#: One frame: (qualified function name, path as py-spy shows it).
Frame = tuple[str, str]


def frame_of(text: str) -> Frame:
    """A raw-format frame ``function (path:line)`` as (function, path); a frame in another
    shape is (text, "")."""
    found = _FRAME.match(text)
    return (found["function"], found["path"]) if found else (text, "")


#: Leaf frames where a thread waits for work: a sample ending in one runs nothing of its own.
WAITS: frozenset[Frame] = frozenset(
    {
        ("InferenceThread._run", "app/serving/executor.py"),  # SimpleQueue.get
        ("_worker", "concurrent/futures/thread.py"),  # ThreadPoolExecutor's work queue
    }
)

#: Threads without Python frames, by the name the kernel shows (``comm``): gRPC core's threads.
THREAD_STAGES: tuple[tuple[str, str], ...] = (
    ("edge", r"^(grpc|event_engine|lifeguard|default-execut|resolver-execut)"),
)

_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)")


def thread_of(stack: Sequence[Frame]) -> int | None:
    """The OS thread id of a ``--threads`` stack (its root frame ``thread (tid): name``), else
    None."""
    found = _THREAD.match(stack[0][0]) if stack else None
    return int(found["tid"], 0) if found else None


def parse_raw(text: str) -> Counter[tuple[Frame, ...]]:
    """py-spy's ``--format raw`` output: samples per stack (root first). Lines that are not
    ``stack count`` are skipped.

    Raises:
        nothing: a malformed line is skipped, not fatal (py-spy writes what it could read).
    """
    stacks: Counter[tuple[Frame, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(frame_of(f) for f in stack.split(";"))] += int(count)
    return stacks


def stage_of(stack: Sequence[Frame], rules: Sequence[Rule] = RULES) -> str:
    """The stage of one stack (root first): that of its leaf-most frame a rule names, else
    ``other``."""
    for function, path in reversed(stack):
        for rule in rules:
            if rule.matches(function, path):
                return rule.stage
    return "other"


def split(stacks: Mapping[tuple[Frame, ...], int]) -> dict[str, int]:
    """Samples per stage, every stage of :data:`STAGES` present (0 where none), waits for work
    (:func:`waiting`) left out."""
    counts = dict.fromkeys(STAGES, 0)
    for stack, count in stacks.items():
        if not waiting(stack):
            counts[stage_of(stack)] += count
    return counts


def waiting(stack: Sequence[Frame]) -> bool:
    """Whether a stack's leaf is a thread's wait for work (:data:`WAITS`)."""
    return bool(stack) and stack[-1] in WAITS


def by_thread(stacks: Mapping[tuple[Frame, ...], int]) -> dict[int | None, dict[str, int]]:
    """Samples per stage (:func:`split`) of each thread (:func:`thread_of`; None: stacks
    without a thread frame), its waits for work (:func:`waiting`) left out."""
    threads: dict[int | None, dict[tuple[Frame, ...], int]] = {}
    for stack, count in stacks.items():
        if not waiting(stack):
            threads.setdefault(thread_of(stack), {})[stack] = count
    return {tid: split(own) for tid, own in threads.items()}


def thread_stage(name: str) -> str:
    """The stage of a thread without Python samples, by its name (:data:`THREAD_STAGES`)."""
    return next((stage for stage, pattern in THREAD_STAGES if re.search(pattern, name)), "native")


def cpu_by_stage(
    samples: Mapping[int | None, Mapping[str, int]], cpu_s: Mapping[int, float], names: Mapping[int, str]
) -> dict[str, float]:
    """CPU seconds per stage: each thread's ``cpu_s`` (tid -> seconds over the window) shared out
    among the stages of its own ``samples`` (:func:`by_thread`), a thread without samples by its
    name in ``names`` (:func:`thread_stage`). Samples of threads without CPU figures (None, or a
    thread gone before the end) are left out: they ran no measured CPU. Every stage of
    :data:`STAGES` is in the answer.

    >>> shares = cpu_by_stage({7: {"edge": 3, "forward": 1}}, {7: 0.8, 9: 0.1}, {9: "grpc_global_tim"})
    >>> round(shares["edge"], 6), round(shares["forward"], 6)
    (0.7, 0.2)
    """
    stages = dict.fromkeys(STAGES, 0.0)
    for tid, seconds in cpu_s.items():
        own = samples.get(tid, {})
        total = sum(own.values())
        if total == 0:
            stages[thread_stage(names.get(tid, ""))] += seconds
            continue
        for stage, count in own.items():
            stages[stage] += seconds * count / total
    return stages


def per_item_us(cpu_s: Mapping[str, float], items: int) -> dict[str, float]:
    """Seconds per stage as microseconds per item answered (every stage 0 without items).

    >>> per_item_us({"edge": 0.6, "forward": 0.2}, items=1000)
    {'edge': 600.0, 'forward': 200.0}
    """
    return {stage: seconds * 1e6 / items if items else 0.0 for stage, seconds in cpu_s.items()}


def top_frames(stacks: Mapping[tuple[Frame, ...], int], stage: str, count: int = 5) -> list[tuple[str, int]]:
    """The ``count`` leaf-most named frames (``function (path)``) with the most samples in
    ``stage``: where a stage's time goes, for the report."""
    found: Counter[str] = Counter()
    for stack, n in stacks.items():
        if stage_of(stack) != stage:
            continue
        named = (f for f in reversed(stack) if any(rule.matches(*f) for rule in RULES))
        function, path = next(named, stack[-1])
        found[f"{function} ({path})"] += n
    return found.most_common(count)


def merge(profiles: Iterable[Mapping[tuple[Frame, ...], int]]) -> Counter[tuple[Frame, ...]]:
    """Several profiles' samples added up (one per worker, one per window)."""
    total: Counter[tuple[Frame, ...]] = Counter()
    for profile in profiles:
        total.update(profile)
    return total
