"""Prompts and tokenizers: the embedded synthetic verifiable task (default, no downloads), datasets through
``datasets`` (local files and folders, Hub dataset ids), and a character tokenizer built locally with
``tokenizers``."""
from __future__ import annotations

import random
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-=?:.,")
# "role: content " per message, then "assistant: " to generate (only characters the tokenizer knows)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def char_tokenizer():
    """A real ``PreTrainedTokenizerFast`` over single characters (ids: pad 0, eos 1, unk 2), with a simple chat
    template so conversational prompts work on the embedded default too."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


class SyntheticAddition(Dataset):
    """``"a+b="`` with single digits and ``a + b <= 9`` (``digits=1``), or operands of ``digits`` digits (sums the
    tiny model cannot do in its head: the tool-use recipe's task); the ``answer`` column is the sum. Verifiable
    by :class:`~segki_lightning.rl.rewards.ExactMatch`; deterministic for a seed."""

    def __init__(self, size: int = 4096, seed: int = 0, digits: int = 1):
        if digits < 1:
            raise ValueError(f"task.digits must be >= 1, got {digits}")
        rng = random.Random(seed)
        if digits == 1:
            pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
            self.rows = [pairs[rng.randrange(len(pairs))] for _ in range(size)]
        else:
            lo, hi = 10 ** (digits - 1), 10 ** digits - 1
            self.rows = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        a, b = self.rows[i]
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(path: str, config: str | None = None, split: str = "train", revision: str | None = None,
              key: str = "task.path"):
    """A ``datasets.Dataset`` from a local data file (.jsonl/.json/.parquet/.csv), a local dataset folder, or a Hub
    dataset id (``datasets.load_dataset(path, config, split=split)``, downloaded into the Hub cache; offline,
    ``HF_HUB_OFFLINE=1``, read from datasets' own cache or a snapshot in the Hub cache). One error naming ``key``
    (and ``task.config`` / ``task.split`` where those are wrong) for anything else."""
    import datasets

    from .model import hub_offline

    p = Path(path)
    if p.is_file():
        return _load_file(p, key)
    if not p.is_dir() and (p.suffix in FILE_KINDS or path.startswith(("/", ".", "~")) or path.count("/") > 1):
        raise FileNotFoundError(f"{key}={path} does not exist (a local file or folder; a Hub dataset id is org/name)")
    where = f"{key}={path}" + (f" (task.config={config})" if config else "")
    try:
        return datasets.load_dataset(str(p) if p.is_dir() else path, config, split=split, revision=revision)
    except ValueError as err:   # an unknown split or config of a dataset that was found
        raise ValueError(f"{where}: {err} -- set task.split / task.config to one it has") from None
    except Exception as err:   # no such dataset, no network, or offline without datasets' cache of it
        folder = _hub_snapshot(path, revision) if not p.is_dir() and hub_offline() else None
        if folder is not None:
            return load_rows(folder, config, split, None, key)
        mode = "in the local caches (HF_HUB_OFFLINE=1)" if hub_offline() else "on the Hub"
        raise FileNotFoundError(f"{where} is neither a local file or folder nor a dataset found {mode}: "
                                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None


def _hub_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The Hub cache's snapshot folder of dataset ``repo_id`` (no download), or None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=True)
    except Exception:
        return None


def _load_file(p: Path, key: str):
    import datasets

    kind = FILE_KINDS.get(p.suffix)
    if kind is None:
        raise ValueError(f"{key}={p}: use a .jsonl, .json, .parquet or .csv file, a dataset folder or a Hub dataset id")
    if p.stat().st_size == 0:
        raise ValueError(f"prompt file {p} is empty: give {key} a file with one prompt per row")
    try:
        return datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as err:   # datasets raises bare StopIteration / its own errors on unreadable files
        raise ValueError(f"prompt file {p} could not be read as {kind}: {type(err).__name__} {err}") from err


class PromptRows(Dataset):
    """Prompts from :func:`load_rows`: ``prompt_column`` holds the prompt (after ``columns`` renames, e.g.
    ``{question: prompt}``); every other column is passed on to the reward functions by name. With
    ``conversational`` (or a ``system_prompt``) a text prompt becomes TRL's conversational form, ``[{"role":
    "system", ...}, {"role": "user", "content": prompt}]``, which the policy's chat template renders."""

    def __init__(self, path: str, prompt_column: str = "prompt", config: str | None = None, split: str = "train",
                 revision: str | None = None, columns: dict[str, str] | None = None, system_prompt: str | None = None,
                 conversational: bool = False, key: str = "task.path"):
        data = load_rows(path, config, split, revision, key)
        if len(data) == 0:
            raise ValueError(f"{key}={path} has no rows (split {split!r})")
        columns = dict(columns or {})
        missing = sorted(set(columns) - set(data.column_names))
        if missing:
            raise ValueError(f"task.columns renames {missing}, which {path} does not have (columns: {data.column_names})")
        self.data = data.rename_columns(columns) if columns else data
        if prompt_column not in self.data.column_names:
            raise ValueError(f"{path} has no column {prompt_column!r} (columns: {self.data.column_names}): set "
                             "task.prompt_column, or rename one with task.columns={<name>: prompt}")
        self.prompt_column, self.system_prompt = prompt_column, system_prompt
        self.conversational = conversational or system_prompt is not None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        row = dict(self.data[i])
        prompt = row.pop(self.prompt_column)
        if self.conversational and isinstance(prompt, str):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            prompt = system + [{"role": "user", "content": prompt}]
        row["prompt"] = prompt
        return row


def check_batch(batch: Any) -> None:
    """A training batch is a dict of column lists with a ``prompt`` column (what ``collate`` makes)."""
    prompts = batch.get("prompt") if isinstance(batch, dict) else None
    if not isinstance(prompts, (list, tuple)) or not prompts:
        got = f"a {type(batch).__name__}" + (f" whose 'prompt' is a {type(prompts).__name__}"
                                             if isinstance(batch, dict) else "")
        raise TypeError(f"training_step needs a batch of prompts (a dict of column lists with a 'prompt' list), got "
                        f"{got}: wrap the dataset in a DataLoader with collate_fn=segki_lightning.rl.task.collate "
                        "and batch_size=<prompts per step>, e.g. ResumableLoader(dataset, batch_size=8, "
                        "collate_fn=collate)")


def collate(rows: list[dict]) -> dict[str, list]:
    """A batch as column lists (prompts stay strings; the module tokenizes)."""
    return {k: [r[k] for r in rows] for k in rows[0]}


def completion_token_ids(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The masked-in tokens of each row (what TRL passes reward functions as ``completion_ids``)."""
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]


def decode(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Completion texts: the masked-in tokens of each row, specials dropped."""
    return tokenizer.batch_decode(completion_token_ids(ids, mask), skip_special_tokens=True)


def cut_at_stop_strings(ids: torch.Tensor, mask: torch.Tensor, tokenizer, stops: Sequence[str]) -> torch.Tensor:
    """Where a row's completion text contains one of ``stops``, mask out (in place) every token after the one
    that completes the first occurrence -- the stop string stays in the completion, as transformers'
    ``stop_strings`` keeps it. ``ids, mask [N, T]``; returns ``[N]`` bool, the rows cut. The shortest such prefix
    is found by bisection over decoded prefixes (a few decodes a cut row)."""
    cut = torch.zeros(ids.shape[0], dtype=torch.bool)
    rows = completion_token_ids(ids, mask)
    hit = lambda toks: any(s in tokenizer.decode(toks, skip_special_tokens=True) for s in stops)   # noqa: E731
    for r, toks in enumerate(rows):
        if not toks or not hit(toks):
            continue
        lo, hi = 1, len(toks)   # the shortest prefix that holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hit(toks[:mid]) else (mid + 1, hi)
        if lo < len(toks):
            keep = mask[r].nonzero().flatten()[lo:]
            mask[r, keep] = 0
        cut[r] = True
    return cut
