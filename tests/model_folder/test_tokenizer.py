"""Tokenizer against transformers' AutoTokenizer on the same folders, and streaming text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from kvserve.engine.tiny_model import ARCHES, training_corpus
from kvserve.model_folder.errors import ModelLoadError
from kvserve.model_folder.tokenizer import Tokenizer

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing  ",
    "Émile visited São Paulo; café naïve — 日本語 😀 and unseen ✓ symbols",
    "line one\nline two\n\n\ttabbed",
    "",
)


@cache
def reference(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(arch, add_special_tokens, tiny_model_dirs):
    ours, theirs = Tokenizer(tiny_model_dirs[arch]), reference(tiny_model_dirs[arch])
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_bos_only_where_the_family_uses_one(tiny_model_dirs):
    llama, qwen = Tokenizer(tiny_model_dirs["llama"]), Tokenizer(tiny_model_dirs["qwen2"])
    assert llama.encode("hi")[0] == llama.bos_token_id
    assert llama.encode("hi", add_special_tokens=False)[0] != llama.bos_token_id
    assert qwen.bos_token_id is None
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("arch", ARCHES)
def test_eos_ids_gather_every_source(arch, tiny_model_dirs):
    folder = tiny_model_dirs[arch]
    tokenizer = Tokenizer(folder)
    generation = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert set(generation) <= tokenizer.eos_token_ids
    assert reference(folder).eos_token_id in tokenizer.eos_token_ids


@pytest.mark.parametrize("arch", ARCHES)
def test_streamed_deltas_join_to_the_decoded_text(arch, tiny_model_dirs):
    tokenizer = Tokenizer(tiny_model_dirs[arch])
    prompt = tokenizer.encode("Say something:")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = tokenizer.detokenizer(prompt)
        deltas = [detokenizer.push([token]) for token in ids]
        deltas.append(detokenizer.finish())
        assert "".join(deltas) == tokenizer.decode(ids)
        assert not any("\ufffd" in delta for delta in deltas)


@pytest.fixture(scope="module")
def sentencepiece_style_dir(tmp_path_factory) -> Path:
    """A Llama 2 / Mistral style tokenizer: Metaspace pieces, byte fallback, a decoder
    that strips the first space — the case where a token's text depends on what precedes."""
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=40,
        show_progress=False,
    )
    trained.train_from_iterator(training_corpus(), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = trained.pre_tokenizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder = tmp_path_factory.mktemp("sentencepiece_style")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_stream_continues_the_prompt_with_context_dependent_decoding(sentencepiece_style_dir):
    tokenizer = Tokenizer(sentencepiece_style_dir)
    prompt = tokenizer.encode("The model reads")
    assert tokenizer.decode(prompt) == "The model reads"
    for text in ("The model reads a long story before lunch 日本語 ✓ ok", "The model reads"):
        generated = tokenizer.encode(text)[len(prompt) :]
        detokenizer = tokenizer.detokenizer(prompt)
        deltas = [detokenizer.push([token]) for token in generated] + [detokenizer.finish()]
        assert not any("\ufffd" in delta for delta in deltas)
        whole = tokenizer.decode(prompt + generated)
        assert "".join(deltas) == whole[len(tokenizer.decode(prompt)) :]


def test_incomplete_character_is_held_until_finish(tiny_model_dirs):
    tokenizer = Tokenizer(tiny_model_dirs["llama"])
    byte_tokens = tokenizer.encode("😀", add_special_tokens=False)
    assert len(byte_tokens) > 1  # rare in the corpus: one token per UTF-8 byte
    detokenizer = tokenizer.detokenizer()
    assert detokenizer.push(byte_tokens[:1]) == ""
    assert detokenizer.finish() == "\ufffd"


def test_special_tokens_are_skipped_in_the_stream(tiny_model_dirs):
    tokenizer = Tokenizer(tiny_model_dirs["qwen2"])
    detokenizer = tokenizer.detokenizer()
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    assert detokenizer.push(tokenizer.encode("Hello")) == "Hello"
    assert detokenizer.push([end_of_turn]) == ""
    assert detokenizer.push(tokenizer.encode(" again")) == " again"


def test_missing_tokenizer_json_is_named(tiny_model_dirs, tmp_path):
    shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        Tokenizer(tmp_path / "m")


def test_corrupt_tokenizer_json_is_named(tiny_model_dirs, tmp_path):
    shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match=r"unreadable tokenizer"):
        Tokenizer(tmp_path / "m")


def test_tokenizer_module_does_not_need_torch(tiny_model_dir):
    """The router imports the tokenizer and chat template without torch installed."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvserve.model_folder.tokenizer import Tokenizer\n"
        f"print(len(Tokenizer({str(tiny_model_dir)!r}).encode_chat("
        "[{'role': 'user', 'content': 'hi'}])))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 3


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
async def test_async_encode_equals_encode(arch, add_special_tokens, tiny_model_dirs):
    tokenizer = Tokenizer(tiny_model_dirs[arch])
    for text in (*TEXTS, "\n".join(training_corpus())[:20_000]):
        expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert await tokenizer.encode_async(text, add_special_tokens=add_special_tokens) == expected
