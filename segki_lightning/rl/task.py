"""Prompts and tokenizers: the embedded synthetic verifiable task (default, no downloads), local JSONL or
Parquet files through ``datasets``, and a character tokenizer built locally with ``tokenizers``."""
from __future__ import annotations

import random
from pathlib import Path
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
    """``"a+b="`` with single digits and ``a + b <= 9``; the ``answer`` column is the sum. Verifiable by
    :class:`~segki_lightning.rl.rewards.ExactMatch`; deterministic for a seed."""

    def __init__(self, size: int = 4096, seed: int = 0):
        rng = random.Random(seed)
        pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
        self.rows = [pairs[rng.randrange(len(pairs))] for _ in range(size)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        a, b = self.rows[i]
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


class PromptFile(Dataset):
    """Rows of a local ``.jsonl`` / ``.json`` / ``.parquet`` file; ``prompt_column`` holds the prompt, all
    other columns are passed on to the reward functions."""

    def __init__(self, path: str, prompt_column: str = "prompt"):
        import datasets

        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"prompt file {path} does not exist: give task.path a local .jsonl or .parquet")
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix)
        if kind is None:
            raise ValueError(f"prompt file {path}: use .jsonl, .json or .parquet")
        if p.stat().st_size == 0:
            raise ValueError(f"prompt file {path} is empty: give task.path a file with one prompt per row")
        try:
            self.data = datasets.load_dataset(kind, data_files=str(p), split="train")
        except Exception as err:   # datasets raises bare StopIteration / its own errors on unreadable files
            raise ValueError(f"prompt file {path} could not be read as {kind}: {type(err).__name__} {err}") from err
        if len(self.data) == 0:
            raise ValueError(f"prompt file {path} has no rows")
        if prompt_column not in self.data.column_names:
            raise ValueError(f"{path} has no column {prompt_column!r} (columns: {self.data.column_names})")
        self.prompt_column = prompt_column

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        row = dict(self.data[i])
        row["prompt"] = row.pop(self.prompt_column)
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
