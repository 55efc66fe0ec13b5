"""Fuzz cases of the CLI's error boundary (zoo/cli/) and of `zoo generate`'s flags: every
failure is one `zoo: error: ...` line with the exit status of its class (zoo/core/errors.py), an
unexpected exception leaves its traceback in a crash file, never on the terminal. Each case runs
in its own subprocess through tests/helpers.py; faults that real inputs cannot provoke on demand
(an allocation failure, a bug) are forced by a snippet that patches one function."""

from __future__ import annotations

import re
from pathlib import Path

import helpers
import numpy as np
import pytest
from helpers import REPO

import zoo
from zoo.core.errors import (
    EXIT_FILESYSTEM,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_RESOURCES,
    EXIT_USAGE,
)
from zoo.text.tokenizers import Tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny GPT-2 checkpoint folder with a byte-level tokenizer: what `zoo generate` reads."""
    folder = tmp_path_factory.mktemp("fuzz_cli") / "tiny"
    model = zoo.Model(zoo.preset("tiny-gpt2"))
    model.init_weights(0)
    model.save_pretrained(folder, tokenizer=Tokenizer.byte_level())
    return folder


def main_with(patch: str, *argv, env: dict | None = None) -> helpers.Result:
    """`zoo ARGV...` in a subprocess after the Python lines `patch` (which force a fault)."""
    code = f"import sys\n{patch}\nfrom zoo.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))"
    return helpers.python(code, env=env)


def raising(target: str, exception: str) -> str:
    """Patch lines that make `target` (module.function) raise `exception` (Python source)."""
    module, name = target.rsplit(".", 1)
    return f"import {module}\ndef _fault(*a, **k):\n    raise {exception}\n{module}.{name} = _fault"


# --- one class, one status ----------------------------------------------------------------


def test_the_exit_statuses_are_the_documented_ones():
    """Scripts rely on docs/troubleshooting.md's table, and the tests below on zoo's constants:
    the two agree."""
    table = dict((word, int(n)) for n, word in re.findall(r"^\| (\d+) \| (\w+)", (REPO / "docs" / "troubleshooting.md")
                                                                    .read_text(), re.M))
    assert (EXIT_INPUT, EXIT_USAGE, EXIT_RESOURCES, EXIT_FILESYSTEM, EXIT_INTERNAL) == (1, 2, 3, 4, 70) == (
        table["input"], table["usage"], table["resources"], table["filesystem"], table["internal"])


def test_input_error_names_the_folder(tmp_path):
    r = helpers.cli("generate", "--from", tmp_path / "nowhere")
    helpers.assert_error(r, str(tmp_path / "nowhere"), "no such file or folder (--from takes", status=EXIT_INPUT)


def test_usage_error_is_argparse_status_2():
    r = helpers.cli("generate", "--prompt", "hi")  # --from is required
    assert r.returncode == EXIT_USAGE, r.stderr
    assert "Traceback" not in r.stderr and "--from" in r.stderr


def test_native_expected_error_is_input_without_a_second_prefix(checkpoint):
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint",
                          'RuntimeError("zoo: sequence length 5000 exceeds max_seq_len 64")'), "inspect", checkpoint)
    line = helpers.assert_error(r, "sequence length 5000 exceeds max_seq_len 64", status=EXIT_INPUT)
    assert line == "zoo: error: sequence length 5000 exceeds max_seq_len 64"


def test_bare_key_error_says_a_key_is_missing(checkpoint):
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint", 'KeyError("config")'), "inspect", checkpoint)
    helpers.assert_error(r, "missing key 'config'", status=EXIT_INPUT)


def test_pydantic_validation_error_is_one_line_naming_the_field(checkpoint):
    patch = raising("zoo.cli.checkpoints.inspect_checkpoint",
                    'pydantic.TypeAdapter(dict[str, int]).validate_python({"n_layer": "many"})')
    r = main_with("import pydantic\n" + patch, "inspect", checkpoint)
    line = helpers.assert_error(r, "n_layer", status=EXIT_INPUT)
    assert len(r.lines) == 1 and "errors.pydantic.dev" not in line, r.stderr


def test_memory_error_is_status_3_naming_the_verb(checkpoint):
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint", "MemoryError('std::bad_alloc')"), "inspect", checkpoint)
    line = helpers.assert_error(r, "not enough memory", "zoo inspect", status=EXIT_RESOURCES)
    assert "std::bad_alloc" not in line  # pybind11's text says nothing more


def test_resource_error_keeps_its_numbers(checkpoint):
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint",
                          "__import__('zoo.core.errors').core.errors.ResourceError('needs 9.0 GiB of memory, 2.0 GiB free')"),
                  "inspect", checkpoint)
    helpers.assert_error(r, "needs 9.0 GiB of memory, 2.0 GiB free", status=EXIT_RESOURCES)


def test_native_arena_allocation_failure_names_the_arena(checkpoint):
    # native/executor/arena.hpp's AllocationError reaches Python as a MemoryError with this text
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint",
                          'MemoryError("zoo: cannot allocate 70000 MiB for the activation arena")'),
                  "inspect", checkpoint)
    line = helpers.assert_error(r, "not enough memory", "cannot allocate 70000 MiB for the activation arena",
                             status=EXIT_RESOURCES)
    assert line.count("zoo:") == 1, line


def test_full_disk_without_a_file_name_names_the_destination(checkpoint, tmp_path):
    r = main_with(raising("zoo.cli.checkpoints.save_pretrained", "OSError(28, 'No space left on device')"),
                  "convert", checkpoint, tmp_path / "dst")
    helpers.assert_error(r, "not enough disk space", f"DST {tmp_path / 'dst'}", status=EXIT_RESOURCES)


def test_full_disk_on_stdout_names_standard_output():
    r = main_with("sys.stdout = open('/dev/full', 'w')", "presets")
    helpers.assert_error(r, "not enough disk space", "<standard output>", status=EXIT_RESOURCES)


def test_file_in_place_of_a_folder_is_a_filesystem_error(checkpoint, tmp_path):
    helpers.write(tmp_path / "file", "not a folder")
    r = helpers.cli("convert", checkpoint, tmp_path / "file" / "out")
    helpers.assert_error(r, str(tmp_path / "file"), status=EXIT_FILESYSTEM)


def test_unwritable_system_folder_is_a_filesystem_error(checkpoint):
    # Tests run as root, whom permissions do not stop: /proc refuses new folders to anyone.
    r = helpers.cli("convert", checkpoint, "/proc/zoo-out")
    helpers.assert_error(r, "/proc/zoo-out", status=EXIT_FILESYSTEM)


def test_os_error_without_a_file_name_still_says_what_failed(checkpoint):
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint", "OSError(5, 'Input/output error')"),
                  "inspect", checkpoint)
    helpers.assert_error(r, "zoo inspect", "a file operation failed", "Input/output error", status=EXIT_FILESYSTEM)


def test_internal_error_leaves_the_traceback_in_a_crash_file(checkpoint, tmp_path):
    cache = tmp_path / "cache"
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint", "AttributeError('x' * 1000 + '\\nsecond line')"),
                  "inspect", checkpoint, env={"XDG_CACHE_HOME": str(cache)})
    line = helpers.assert_error(r, "internal error (AttributeError: xxx", "please report it", status=EXIT_INTERNAL)
    assert "second line" not in line and len(line) < 600
    crash = Path(re.search(r"the full traceback is in (\S+);", line).group(1))
    assert crash.parent == cache / "zoo" / "crashes"
    text = crash.read_text()
    assert "Traceback (most recent call last)" in text and "_fault" in text and "second line" in text
    assert f"zoo inspect {checkpoint}" in text


def test_crash_file_falls_back_to_the_temp_folder(checkpoint, tmp_path):
    helpers.write(tmp_path / "cache", "a file where the cache folder would be")
    (tmp_path / "tmp").mkdir()
    r = main_with(raising("zoo.cli.checkpoints.inspect_checkpoint", "TypeError('incompatible function arguments')"),
                  "inspect", checkpoint,
                  env={"XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")})
    line = helpers.assert_error(r, "internal error (TypeError: incompatible function arguments)", str(tmp_path / "tmp"),
                             status=EXIT_INTERNAL)
    crash = Path(re.search(r"the full traceback is in (\S+);", line).group(1))
    assert "TypeError" in crash.read_text()


def test_broken_pipe_ends_quietly_with_0():
    # stdout is a pipe whose reader is gone (`zoo presets | head -n 0`)
    r = main_with("import os\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)", "presets")
    assert r.returncode == 0 and r.stderr == "", r.stderr


# --- zoo generate: every numeric flag checked before work starts ------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-0.5"),
    ("--top-k", "0"), ("--top-k", "-3"),
    ("--top-p", "0"), ("--top-p", "nan"), ("--top-p", "1.5"), ("--top-p", "-inf"),
    ("--max-new-tokens", "-1"), ("--seed", "-1"),
    ("--threads", "0"), ("--threads", str(2**40)),
])
def test_generate_refuses_a_bad_flag_value(checkpoint, flag, value):
    r = helpers.cli("generate", "--from", checkpoint, "--prompt", "hi", f"{flag}={value}")  # = for -inf
    helpers.assert_error(r, flag, status=EXIT_INPUT)
    assert r.stdout == ""  # refused before the prompt is echoed


@pytest.mark.parametrize("verb, flag, value", [
    ("inspect", "--batch", "0"), ("inspect", "--seq-len", "-1"),
    ("convert", "--max-shard-gb", "nan"), ("convert", "--max-shard-gb", "0"),
])
def test_other_verbs_refuse_a_bad_flag_value(checkpoint, tmp_path, verb, flag, value):
    where = [checkpoint] if verb == "inspect" else [checkpoint, tmp_path / "out"]
    r = helpers.cli(verb, *where, flag, value)
    helpers.assert_error(r, flag, status=EXIT_INPUT)
    assert not (tmp_path / "out").exists()


def test_generate_with_a_tiny_temperature_samples_the_top_token(checkpoint):
    # logits / 5e-324 overflow to inf; the sampler must not turn that into NaN probabilities
    greedy = helpers.cli("generate", "--from", checkpoint, "--prompt", "hi", "--max-new-tokens", "8",
                         "--temperature", "0")
    tiny = helpers.cli("generate", "--from", checkpoint, "--prompt", "hi", "--max-new-tokens", "8",
                    "--temperature", "5e-324")
    assert greedy.returncode == 0 and tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout


def test_nan_weights_in_a_checkpoint_stop_generate_with_one_line(checkpoint, tmp_path):
    model = zoo.Model.from_pretrained(checkpoint)
    model.parameters()["transformer.wte.weight"][3, :] = np.nan
    model.save_pretrained(tmp_path / "nan", tokenizer=Tokenizer.byte_level())
    r = helpers.cli("generate", "--from", tmp_path / "nan", "--prompt", "hi", "--temperature", "0")
    # Either loading refuses the non-finite weights, or generation stops at the first NaN logits.
    line = helpers.assert_error(r, str(tmp_path / "nan"), status=EXIT_INPUT)
    assert "Probabilities contain NaN" not in line
    assert re.search(r"non-finite|NaN", line), line


def test_nan_logits_stop_generate_at_their_position(checkpoint):
    # The model is damaged after loading, so that generate's own check answers, whatever loading checks.
    patch = ("import numpy as np, zoo.io.load\n_load = zoo.io.load.load_model\n"
             "def _damaged(*a, **k):\n    m = _load(*a, **k)\n"
             "    m.parameters()['transformer.wte.weight'][:] = np.inf\n    return m\n"
             "zoo.io.load.load_model = _damaged")
    r = main_with(patch, "generate", "--from", checkpoint, "--prompt", "hi", "--temperature", "0.7")
    helpers.assert_error(r, f"--from {checkpoint}", "non-finite logits", "position 2", "probably damaged",
                      status=EXIT_INPUT)
