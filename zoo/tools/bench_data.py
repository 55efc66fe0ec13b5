"""`python -m zoo.tools.bench_data`: tokenizing a chat data set from Parquet against the same
records as JSONL, on this CPU.

The data set is generated here (seeded): chats of one to three user/assistant exchanges, a
system prompt in some, words drawn from a fixed list, until the JSONL file reaches --mb
megabytes; the same records go to a Parquet file (row groups of --row-group rows, written as
they are generated, so neither file is ever held whole in memory). Each file is then tokenized
into zoo's token cache (zoo.train.data.tokenize_files: records read, chats rendered with the chat
template, encoded, the loss mask written) in a process of its own, so that its peak resident
memory (ru_maxrss) is its own: a Parquet file is read BATCH_ROWS rows at a time, so its peak
stays near the JSONL reader's, whatever the size of the file. The two token caches must be
identical (compared by SHA-256): the same tokens and mask from either format.

The tokenizer is byte-level by default (the fastest encoder: the reading's share of the time is
then largest), or a tokenizer folder (--tokenizer). Each format is timed --rounds times (a fresh
cache each time) and its best round kept. A Markdown table goes to stdout (progress to stderr),
the same numbers as JSON to --json FILE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

WORDS = ("the a of to and in is it you that he was for on are with as I his they be at one have this from or "
         "had by hot word but what some we can out other were all there when up use your how said an each she "
         "which do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find any new work part take get place made live where after back little "
         "only round man year came show every good me give our under name very through just form sentence great "
         "think say help low line differ turn cause much mean before move right boy old too same tell does set "
         "three want air well also play small end put home read hand port large spell add even land here must big "
         "high such follow act why ask men change went light kind off need house picture try us again animal point "
         "mother world near build self earth father head stand own page should country found answer school grow "
         "study still learn plant cover food sun four between state keep eye never last let thought city tree "
         "cross farm hard start might story saw far sea draw left late run don't while press close night real life "
         "few north open seem together next white children begin got walk example ease paper group always music "
         "those both mark often letter until mile river car feet care second book carry took science eat room "
         "friend began idea fish mountain stop once base hear horse cut sure watch color face wood main enough "
         "plain girl usual young ready above ever red list though feel talk bird soon body dog family direct pose "
         "leave song measure door product black short numeral class wind question happen complete ship area half "
         "rock order fire south problem piece told knew pass since top whole king space heard best hour better "
         "true during hundred five remember step early hold west ground interest reach fast verb sing listen six "
         "table travel less morning ten simple several vowel toward war lay against pattern slow center love "
         "person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain "
         "fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done "
         "beauty drive stood contain front teach week final gave green oh quick develop ocean warm free minute "
         "strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel full "
         "force blue object decide surface deep moon island foot system busy test record boat common gold possible "
         "plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring "
         "yes distant fill east paint language among").split()


def chat_records(seed: int):
    """An endless, seeded stream of chat records ({"messages": [...]})."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(WORDS)

    def sentence(lo, hi):
        n = int(rng.integers(lo, hi))
        text = " ".join(words[rng.integers(0, len(words), n)])
        return text[0].upper() + text[1:] + "."

    while True:
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": sentence(5, 15)})
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": " ".join(sentence(4, 20) for _ in range(rng.integers(1, 3)))})
            messages.append({"role": "assistant",
                             "content": " ".join(sentence(6, 30) for _ in range(rng.integers(1, 6)))})
        yield {"messages": messages}


def generate(folder: Path, megabytes: float, row_group: int, seed: int = 0) -> tuple[Path, Path, int]:
    """chats.jsonl of about `megabytes` MB, and chats.parquet of the same records; their row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = folder / "chats.jsonl", folder / "chats.parquet"
    target = int(megabytes * 1e6)
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    rows = written = 0
    batch: list[dict] = []
    with open(jsonl, "w", encoding="utf-8") as out, pq.ParquetWriter(parquet, schema) as writer:
        for record in chat_records(seed):
            line = json.dumps(record) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            batch.append(record)
            rows += 1
            if len(batch) == row_group or written >= target:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=row_group)
                batch = []
            if written >= target:
                break
    return jsonl, parquet, rows


def _tokenizer(folder):
    from zoo.text.tokenizers import Tokenizer

    return Tokenizer.byte_level() if folder is None else Tokenizer.from_pretrained(folder)


def worker(path: str, cache: str, tokenizer_dir) -> dict:
    """Tokenize one file into a fresh cache: seconds, tokens, the caches' digest, peak memory."""
    from zoo.text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
    from zoo.train.data import tokenize_files

    tok = _tokenizer(tokenizer_dir)
    template = ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback", tok.bos_token, tok.eos_token)
    start = time.perf_counter()
    tf = tokenize_files([path], tok, cache, template)
    seconds = time.perf_counter() - start
    h = hashlib.sha256()
    for suffix in (".bin", ".trained", ".starts"):
        with open(tf.path.with_suffix(suffix), "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return {"seconds": seconds, "tokens": int(tf.n_tokens), "examples": len(tf.starts) - 1,
            "digest": h.hexdigest(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run_worker(path: Path, cache: Path, tokenizer_dir, threads: int) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "zoo.tools.bench_data", "--worker", str(path), "--cache", str(cache)]
    if tokenizer_dir:
        cmd += ["--tokenizer", str(tokenizer_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the worker for {path} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=20.0, help="size of the JSONL file, MB (default 20: well under a "
                                                          "minute on 2 cores; 1000 for the 1 GB run)")
    p.add_argument("--row-group", type=int, default=10_000, help="Parquet rows per row group (default 10000)")
    p.add_argument("--rounds", type=int, default=1, help="times each format is tokenized; the best kept (default 1)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: byte-level)")
    p.add_argument("--dir", default=None, metavar="DIR", help="where the data and caches go (default: a temporary "
                                                             "folder, removed at the end)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the workers (default 2)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache, args.tokenizer)))
        return 0
    if args.mb <= 0 or args.rounds < 1 or args.row_group < 1:
        p.error("--mb, --rounds and --row-group must be positive")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        p.error("needs pyarrow: pip install 'zoo[data]'")

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zoo-bench-data-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        print(f"generating {args.mb:g} MB of chats in {folder} ...", file=sys.stderr)
        start = time.perf_counter()
        jsonl, parquet, rows = generate(folder, args.mb, args.row_group)
        print(f"  {rows:,} records in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        results = {}
        for name, path in (("jsonl", jsonl), ("parquet", parquet)):
            best = None
            for r in range(args.rounds):
                got = _run_worker(path, folder / f"cache-{name}", args.tokenizer, args.threads)
                print(f"  {name} round {r + 1}: {got['seconds']:.2f} s, peak RSS {got['peak_rss_mb']:.0f} MB",
                      file=sys.stderr)
                if best is None or got["seconds"] < best["seconds"]:
                    best = got
            results[name] = {**best, "file_mb": path.stat().st_size / 1e6,
                             "jsonl_mb_per_s": jsonl.stat().st_size / 1e6 / best["seconds"],
                             "records_per_s": rows / best["seconds"], "tokens_per_s": best["tokens"] / best["seconds"]}
        same = results["jsonl"]["digest"] == results["parquet"]["digest"]
        ratio = results["jsonl"]["seconds"] / results["parquet"]["seconds"]
        report = {
            "schema": "zoo-bench-data/1", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": _cpu(), "threads": args.threads, "rows": rows, "row_group": args.row_group, "mb": args.mb,
            "tokenizer": args.tokenizer or "byte-level", "rounds": args.rounds, "results": results,
            "parquet_speed_vs_jsonl": ratio, "same_tokens": same,
        }
        print(f"\n{rows:,} chat records, {report['tokenizer']} tokenizer, best of {args.rounds} round(s), "
              f"{args.threads} threads\n")
        print("| format | file MB | seconds | MB/s (of the JSONL) | records/s | tokens/s | peak RSS MB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, r in results.items():
            print(f"| {name} | {r['file_mb']:,.1f} | {r['seconds']:.2f} | {r['jsonl_mb_per_s']:.2f} | "
                  f"{r['records_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} |")
        print(f"\nParquet at {ratio:.2f}x the speed of JSONL; the same tokens and loss mask: {'yes' if same else 'NO'}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return 0 if same else 1
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
