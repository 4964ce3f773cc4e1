"""What README.md, docs/model-repository.md and docs/reliability.md say the server answers, asked
of the in-process app: the extensions ``GET /v2`` lists, the status of a request with more items
than the model's ``queue_capacity``, and that of a deadline of ``inf``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.gunicorn import ROOT
from tests.support.metrics import v2_body
from tests.support.toy_models import write_scale_model


def section(text: str, title: str) -> str:
    """The Markdown section under the heading ``title``, to the next heading."""
    start = text.index(title)
    following = re.search(r"\n#+ ", text[start + len(title) :])
    return text[start : start + len(title) + following.start()] if following else text[start:]


async def test_the_docs_say_what_the_server_answers(make_client: Callable[..., Any], tmp_path: Path) -> None:
    write_scale_model(tmp_path, queue_capacity=8)
    client = await make_client(tmp_path)
    readme = (ROOT / "README.md").read_text()

    served = (await (await client.get("/v2")).json())["extensions"]
    listed = re.search(r"`GET /v2` \(lists the extensions served:\s*(.*?)\)", readme, re.S)
    assert listed is not None and re.findall(r"`(\w+)`", listed.group(1)) == served

    resp = await client.post("/v2/models/scale/infer", json=v2_body(1.0, items=9))
    assert resp.status == 413 and "queue_capacity" in await resp.text()
    errors = re.search(r"413 body, (.*?), 415", readme, re.S)
    assert errors is not None and "`queue_capacity`" in errors.group(1)
    row = next(line for line in (ROOT / "docs/model-repository.md").read_text().splitlines()
               if line.startswith("| `queue_capacity` |"))  # fmt: skip
    assert "(more: 413)" in row

    resp = await client.post("/v2/models/scale/infer", json=v2_body(1.0), headers={"X-Request-Timeout-Ms": "inf"})
    assert resp.status == 400
    deadlines = section((ROOT / "docs/reliability.md").read_text(), "### Deadline cap")
    assert "`inf`" in deadlines and "refused with 400" in deadlines
    assert not re.search(r"`inf`[^.]*clipped", deadlines)
