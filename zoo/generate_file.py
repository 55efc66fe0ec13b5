"""`zoo generate --prompts FILE`: a file of prompts, decoded together (generate_batch), one JSON
line out per prompt, in the file's order.

The file: JSON Lines (`.jsonl`), each line an object whose "prompt" is the text; or any other
text file, one prompt per non-empty line (a line's text as it stands, without its newline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, TextIO

from .core.errors import CheckpointError
from .core.files import read_text
from .generate import generate_batch, prompt_tokens


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file (see the module's doc); CheckpointError naming the file and line for
    a line that is no object with a "prompt" string, or for a file without any prompt."""
    path = Path(path)
    text = read_text(path, "prompts file")
    prompts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix.lower() != ".jsonl":
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckpointError(path, f"line {number}: not JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise CheckpointError(path, f'line {number}: expected an object with a "prompt" string, got '
                                        f"{line[:60]!r}")
        prompts.append(record["prompt"])
    if not prompts:
        raise CheckpointError(path, 'no prompts in this file (one per line, or JSON Lines of {"prompt": ...})')
    return prompts


def generate_file(model, tokenizer, path: str | Path, max_new_tokens: int, temperature: float = 0.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
                  batch_size: int = 8, out: Optional[TextIO] = None) -> int:
    """Every prompt of the file continued as `zoo generate --prompt` continues one (BOS first,
    stopping at the tokenizer's end-of-text; prompt i samples with generator (seed, i)),
    batch_size at a time; each line {"prompt": ..., "completion": ..., "new_tokens": n} written
    as soon as its prompt and every one before it are done. Returns how many it wrote."""
    out = out if out is not None else sys.stdout
    texts = read_prompts(path)
    ids = [prompt_tokens(tokenizer, t) for t in texts]
    stop = set(tokenizer.eos_ids)
    done: dict[int, list[int]] = {}
    written = 0

    def on_done(i: int, new: list[int]) -> None:
        nonlocal written
        done[i] = new
        while written in done:
            new = done.pop(written)
            completion = tokenizer.decode([t for t in new if t not in stop])
            out.write(json.dumps({"prompt": texts[written], "completion": completion, "new_tokens": len(new)},
                                 ensure_ascii=False) + "\n")
            out.flush()
            written += 1

    generate_batch(model, ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids=stop,
                   batch_size=batch_size, on_done=on_done)
    return written
