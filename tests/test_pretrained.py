"""model.pretrained: a local folder or a Hub model id read from the Hub cache (built here in the cache's own
layout, offline: no test touches the network), the checkpoint's own dtype by default, one clear error for an id
that is neither."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from segki_lightning.rl.model import load_pretrained, resolve_checkpoint, tiny_qwen35
from segki_lightning.rl.task import char_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A float32 tiny Qwen3.5 checkpoint with its tokenizer."""
    out = tmp_path_factory.mktemp("ckpt")
    tok = char_tokenizer()
    tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id, seed=int(torch.randint(0, 1000, ()))).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, folder):
    """A Hub cache holding ``segki-test/tiny`` (refs/main -> one snapshot), offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--segki-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / commit


def test_a_local_folder_keeps_its_dtype_unless_told(folder, caplog):
    model, tok = load_pretrained(str(folder))
    assert {p.dtype for p in model.parameters()} == {torch.float32} and tok.pad_token_id is not None
    with caplog.at_level(logging.INFO, logger="segki_lightning"):
        model, _ = load_pretrained(str(folder), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert "model.dtype=bfloat16 casts" in caplog.text and "torch.float32" in caplog.text


def test_a_hub_id_loads_from_the_cache_offline(hub_cache, folder):
    assert resolve_checkpoint("segki-test/tiny") == str(hub_cache)
    model, _ = load_pretrained("segki-test/tiny")
    want, _ = load_pretrained(str(folder))
    for (n, a), (_, b) in zip(model.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_missing_hub_id_offline_is_one_clear_error(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"model.pretrained=segki-test/other \(model.revision=v1\) is not a "
                                                r"local folder .*HF_HUB_OFFLINE=1"):
        resolve_checkpoint("segki-test/other", revision="v1")
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub model id"):
        resolve_checkpoint("/no/such/folder//x")
