"""The command blocks of README.md and docs/*.md, read from the files themselves so that a stale example fails:
the blocks and their doc-test markers, each command shrunk to a test's size, and the ways to run one.

A marker is an HTML comment on the lines right before a block's opening fence (several may stand there):

    <!-- doc-test: skip reason=TEXT -->                      not run here; TEXT says why (and what runs it instead)
    <!-- doc-test: skip by=tests/FILE.py reason=TEXT -->     run by that test file, which takes it from block_by()
    <!-- doc-test: slow reason=TEXT -->                      run only with -m slow; TEXT names the tests that cover it
    <!-- doc-test: setup=NAME -->                            a named setup writes the files the block's placeholders
                                                             name into its directory first (tests/test_docs_commands.py)
    <!-- doc-test: args="KEY=VALUE ..." nproc=N -->          more overrides (they replace the block's own values of
                                                             those keys); N processes instead of the block's
    <!-- doc-test: replace="OLD=NEW ..." -->                 words of the block replaced before it runs (placeholders,
                                                             paths outside the test's directory)

`match="TEXT"` limits a marker to the commands containing TEXT; `reason=` takes the rest of the comment. Every
command of a block runs in order in one fresh directory (relative paths land there), the k-th with `run_dir=runs/k`
unless it names its own; a recipe run is shrunk (`shrink`): 2 steps, the tiny model of its family, short sequences,
no evaluation, sample or W&B. Blocks fenced as bash/sh/shell hold commands, one a line (backslash continues one;
`&&` chains); python blocks are run whole. Other fences (layouts, outputs) are not commands.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell")
MAX_PROCESSES = 4
KEPT_MODELS = ("tiny", "moe_tiny", "hf")  # the tiny ones, and model=hf (its size is the config file's)
#: What every recipe run is shrunk to (a command's own value of a key is replaced).
SHRUNK = {"train.steps": "2", "train.eval_batches": "0", "train.sample_tokens": "0", "train.progress": "false",
          "wandb.mode": "disabled"}
MAX_SEQ_LEN, MAX_MICRO_BATCH = 128, 2
STDLIB_BYTES = "1000000"  # the default corpus's first megabyte: enough for a few 128-token batches
MARKER_KEYS = ("match", "by", "setup", "args", "nproc", "replace", "reason")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Marker:
    verb: str | None  # "skip", "slow" or None (options only)
    options: dict[str, str]

    def applies_to(self, text: str) -> bool:
        return self.options.get("match", "") in text


@dataclass
class Command:
    """One command of a block: `python -m MODULE ARGS`, `torchrun OPTS -m MODULE ARGS`, `mkdir -p DIR`, a pip
    install (the environment the tests run in) or a whole python block (`code`)."""

    block: Block
    index: int  # 1-based, in the block
    text: str  # as written (one logical line), for ids and messages
    kind: str  # "module", "torchrun", "mkdir", "install", "python" or "unknown"
    module: str | None = None
    args: list[str] = field(default_factory=list)
    nproc: int = 1
    launcher_opts: list[str] = field(default_factory=list)
    code: str | None = None
    error: str | None = None  # why a command of kind "unknown" could not be read

    def unknown(self) -> str:
        """The message of a command the doc tests cannot run, which no marker skips."""
        why = f" ({self.error})" if self.error else ""
        return (f"{self.id}: `{self.text}`{why} is not a command the doc tests can run (python -m MODULE ..., "
                f"torchrun ... -m MODULE ..., mkdir -p DIR, pip install ...): mark the block (or the command, with "
                f"match=) <!-- doc-test: skip reason=... -->, saying why it cannot run in a test")

    @property
    def id(self) -> str:
        return f"{self.block.id}#{self.index}"

    def markers(self) -> list[Marker]:
        return [m for m in self.block.markers if m.applies_to(self.text)]

    def option(self, key: str) -> str | None:
        values = [m.options[key] for m in self.markers() if key in m.options]
        return values[-1] if values else None

    def verdict(self) -> tuple[str, str] | None:
        """("skip" | "slow", reason) from the markers, or None: runs in the default suite."""
        for verb in ("skip", "slow"):
            for m in self.markers():
                if m.verb == verb:
                    return verb, m.options.get("reason", "")
        return None


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    fence: str
    text: str
    markers: list[Marker]

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[Command]:
        text = self._replaced(self.text)
        if self.fence == "python":
            return [Command(self, 1, self.text.strip().splitlines()[0], "python", code=text)]
        logical = re.sub(r"\\\n", " ", text)
        commands = []
        for line in logical.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError as e:  # (a quote running over lines: not one of the commands run here)
                commands.append(Command(self, len(commands) + 1, line.strip(), "unknown", error=str(e)))
                continue
            segments = [[]]
            for w in words:
                if w == "&&":
                    segments.append([])
                else:
                    segments[-1].append(w)
            for words in filter(None, segments):
                commands.append(_parse(self, len(commands) + 1, words))
        return commands

    def _replaced(self, text: str) -> str:
        for m in self.markers:
            for pair in shlex.split(m.options.get("replace", "")):
                old, new = pair.split("=", 1)
                text = text.replace(old, new)
        return text


def _parse(block: Block, index: int, words: list[str]) -> Command:
    text = shlex.join(words)
    head = words[0]
    if head == "python" and len(words) > 2 and words[1] == "-m":
        return Command(block, index, text, "module", module=words[2], args=words[3:])
    if head == "torchrun":
        at = words.index("-m") if "-m" in words else len(words)
        nproc, opts, given = 1, [], iter(words[1:at])
        for o in given:
            if o == "--nproc_per_node":
                nproc = int(next(given))
            else:
                opts.append(o)
        if at + 1 < len(words):
            return Command(block, index, text, "torchrun", module=words[at + 1], args=words[at + 2:], nproc=nproc,
                           launcher_opts=opts)
    if head == "mkdir" and words[1:2] == ["-p"]:
        return Command(block, index, text, "mkdir", args=words[2:])
    if words[:2] == ["pip", "install"]:
        return Command(block, index, text, "install", args=words[2:])
    return Command(block, index, text, "unknown")


def _marker(comment: str, where: str) -> Marker:
    body, _, reason = comment.partition("reason=")
    words = shlex.split(body)
    verb = words.pop(0) if words and words[0] in ("skip", "slow") else None
    options = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or key not in MARKER_KEYS:
            raise ValueError(f"{where}: doc-test marker word {w!r} is not one of skip, slow or {', '.join(MARKER_KEYS)}"
                             f"=VALUE")
        options[key] = value
    if reason.strip():
        options["reason"] = reason.strip()
    if verb and not options.get("reason"):
        raise ValueError(f"{where}: a doc-test {verb} marker needs reason=... (why, and what covers it instead)")
    return Marker(verb, options)


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, each with the doc-test markers just above it."""
    lines = path.read_text().splitlines()
    found, pending, i = [], [], 0
    rel = path.relative_to(REPO)
    while i < len(lines):
        stripped = lines[i].strip()
        marker = re.fullmatch(r"<!--\s*doc-test:(.*?)-->", stripped)
        if marker:
            pending.append(_marker(marker.group(1), f"{rel}:{i + 1}"))
            i += 1
            continue
        fence = re.fullmatch(r"(\s*)```(\w*)\s*", lines[i])
        if fence:
            indent, start = fence.group(1), i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            found.append(Block(path, start + 1, fence.group(2), "\n".join(body) + "\n", pending))
            pending = []
        elif pending and stripped:
            raise ValueError(f"{rel}:{i + 1}: a doc-test marker must stand right before a code block")
        i += 1
    if pending:
        raise ValueError(f"{rel}: a doc-test marker at the end of the file, before no code block")
    return found


def all_commands() -> list[Command]:
    """Every command of every shell and python block of README.md and docs/*.md, in file order."""
    return [c for path in doc_files() for b in blocks(path) if b.fence in (*SHELL_FENCES, "python")
            for c in b.commands()]


def block_by(test_file: str) -> Block:
    """The one block whose marker says `by=test_file` (that test runs it in its own way)."""
    owned = [b for path in doc_files() for b in blocks(path) if any(m.options.get("by") == test_file
                                                                    for m in b.markers)]
    assert len(owned) == 1, f"{len(owned)} blocks of README.md / docs/*.md are marked by={test_file} (expected one)"
    return owned[0]


def tiny_model(name: str) -> str:
    """The tiny model of a model file's family: moe_tiny for an MoE one, else tiny."""
    if name in KEPT_MODELS:
        return name
    import yaml

    spec = yaml.safe_load((REPO / "recipes" / "conf" / "model" / f"{name}.yaml").read_text())
    return "moe_tiny" if (spec.get("moe") or {}).get("num_experts") else "tiny"


def _set(args: list[str], key: str, value: str) -> list[str]:
    """args with `key=value` in place of the command's own value of key (`+key=`/`++key=` too), else appended."""
    kept = [a for a in args if a.lstrip("+").partition("=")[0] != key]
    return [*kept, f"{key}={value}"]


def _value(args: list[str], key: str) -> str | None:
    for a in reversed(args):
        k, eq, v = a.lstrip("+").partition("=")
        if eq and k == key:
            return v
    return None


def shrink(command: Command) -> tuple[list[str], int]:
    """(the arguments after the module, the number of processes) a test runs the command with."""
    args = list(command.args)
    if command.module == "recipes.pretrain":
        model = _value(args, "model") or "default"
        args = _set(args, "model", tiny_model(model))
        for key, value in SHRUNK.items():
            args = _set(args, key, value)
        seq_len = _value(args, "train.seq_len")
        if seq_len is None or int(seq_len) > MAX_SEQ_LEN:
            args = _set(args, "train.seq_len", str(MAX_SEQ_LEN))
        micro = _value(args, "train.micro_batch_size")
        if micro is None or int(micro) > MAX_MICRO_BATCH:
            args = _set(args, "train.micro_batch_size", str(MAX_MICRO_BATCH))
        if (_value(args, "data") or "stdlib") == "stdlib":
            args = _set(args, "data.max_bytes", STDLIB_BYTES)
        if _value(args, "run_dir") is None:
            args = _set(args, "run_dir", f"runs/{command.index}")
    for extra in shlex.split(command.option("args") or ""):
        key, eq, value = extra.partition("=")
        if eq and not key.startswith("-"):
            args = _set(args, key, value)
        else:
            args.append(extra)
    nproc = int(command.option("nproc") or command.nproc)
    if nproc > MAX_PROCESSES:
        raise ValueError(f"{command.id}: `{command.text}` starts {nproc} processes (tests start at most "
                         f"{MAX_PROCESSES}): give it a marker <!-- doc-test: match=\"...\" nproc=N args=\"...\" --> "
                         f"with the layout to test on N <= {MAX_PROCESSES}")
    return args, nproc
