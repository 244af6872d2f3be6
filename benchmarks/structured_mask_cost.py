"""Per-token cost of a JSON-schema token mask on CPU: llguidance vs xgrammar vs outlines-core.

For each of ``--schemas`` random schemas (the tests' generator) every library compiles the
schema for the tiny model's tokenizer, then walks up to ``--tokens`` tokens: compute the
mask of allowed next tokens (timed), pick one allowed token at random, advance. What a
random-weight model does under constraint, minus the model. Reported: compile time per
schema, mask time per token (mean, p50, p99), schemas that failed to compile.

    python benchmarks/structured_mask_cost.py --schemas 50 --tokens 200
    python benchmarks/structured_mask_cost.py --vocab 32000   # a realistic vocabulary

``--vocab N`` retrains the tiny model's byte-level BPE to N tokens on a synthetic corpus
(same special tokens, same ids), since mask cost grows with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

from kvserve.core.structured_output import StructuredOutput
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.engine.tiny_model import make_tiny_model
from kvserve.model_folder.tokenizer import Tokenizer
from tests.support.json_schemas import random_schemas

# fill(): compute the mask into the walker's bitmask (the timed part); its bitmask;
# advance(token); done() -> bool
Walker = tuple[Callable[[], object], torch.Tensor, Callable[[int], object], Callable[[], bool]]


@dataclass
class Result:
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    failed: int = 0  # schemas the library refused
    finished: int = 0  # walks that reached the grammar's end
    valid: int = 0  # of those, text that parses and validates against the schema


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def llguidance_factory(model_dir: Path, tok: Tokenizer, vocab: int) -> Callable[[str], Walker]:
    """llguidance as the engine drives it (kvserve's GrammarCompiler and GrammarMatcher)."""
    compiler = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    compiler.prepare()

    def make(schema: str) -> Walker:
        matcher = compiler.matcher(StructuredOutput(schema))
        bitmask = compiler.new_bitmask(1)

        def fill() -> None:
            matcher.fill_bitmask(bitmask, 0)

        def done() -> bool:
            return matcher.finished

        return fill, bitmask, matcher.accept, done

    return make


def xgrammar_factory(model_dir: Path, tok: Tokenizer, vocab: int) -> Callable[[str], Walker]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def make(schema: str) -> Walker:
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def fill() -> None:
            matcher.fill_next_token_bitmask(bitmask)

        return fill, bitmask, matcher.accept_token, matcher.is_terminated

    return make


def outlines_factory(model_dir: Path, tok: Tokenizer, vocab: int) -> Callable[[str], Walker]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    # Byte-level BPE spells bytes as printable characters (GPT-2's table); undo it.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    byte_of = {
        chr(c): b
        for c, b in zip(chars, printable + sorted(set(range(256)) - set(printable)), strict=True)
    }
    eos = min(tok.eos_token_ids)
    tokens: dict[bytes, list[int]] = {}
    data = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["id"] for t in data["added_tokens"]}
    for text, token_id in data["model"]["vocab"].items():
        if token_id not in special and token_id != eos:
            tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
    vocabulary = Vocabulary(eos, tokens)

    def make(schema: str) -> Walker:
        guide = Guide(Index(build_regex_from_schema(schema), vocabulary))
        bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

        def fill() -> None:
            guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

        return fill, bitmask, guide.advance, guide.is_finished

    return make


def measure(
    make: Callable[[str], Walker],
    schemas: list[str],
    tokens: int,
    tok: Tokenizer,
    vocab: int,
    seed: int,
) -> Result:
    result = Result()
    rng = random.Random(seed)
    for schema in schemas:
        start = time.perf_counter()
        try:
            fill, bitmask, advance, done = make(schema)
        except Exception:
            result.failed += 1
            continue
        result.compile_s.append(time.perf_counter() - start)
        walked: list[int] = []
        for _ in range(tokens):
            start = time.perf_counter()
            fill()
            result.mask_s.append(time.perf_counter() - start)
            allowed = _allowed(bitmask[0], vocab)
            if not allowed or done():
                break
            token = rng.choice(allowed)
            walked.append(token)
            advance(token)
            if done():
                break
        if done():
            result.finished += 1
            result.valid += _valid(tok.decode(walked), json.loads(schema))
    return result


def _valid(text: str, schema: dict[str, object]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def widen_vocabulary(model_dir: Path, vocab_size: int, seed: int) -> None:
    """Retrains ``tokenizer.json`` to ``vocab_size`` tokens, keeping the special tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path = model_dir / "tokenizer.json"
    special = [
        t["content"]
        for t in sorted(json.loads(path.read_text())["added_tokens"], key=lambda t: t["id"])
    ]
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,:;{}[]\"' "
    words = ["".join(rng.choices(letters, k=rng.randint(2, 12))) for _ in range(4 * vocab_size)]
    corpus = [" ".join(rng.choices(words, k=200)) for _ in range(vocab_size // 10)]
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(path))
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] = tokenizer.get_vocab_size()
    (model_dir / "config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--vocab", type=int, default=None, help="retrain to this many tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()), args.arch)
    if args.vocab is not None:
        widen_vocabulary(model_dir, args.vocab, args.seed)
    tok = Tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    schemas = [json.dumps(s) for s in random_schemas(args.schemas, args.seed)]
    factories: dict[str, Callable[[Path, Tokenizer, int], Callable[[str], Walker]]] = {
        "llguidance": llguidance_factory,
        "xgrammar": xgrammar_factory,
        "outlines-core": outlines_factory,
    }
    print(f"vocab {vocab}, {len(schemas)} schemas, up to {args.tokens} tokens each")
    print(
        "library        setup_s  compile_ms_p50  compile_ms_max  mask_us_mean  p50    p99"
        "   tokens  failed  finished  valid"
    )
    for name, factory in factories.items():
        start = time.perf_counter()
        make = factory(model_dir, tok, vocab)
        setup = time.perf_counter() - start
        r = measure(make, schemas, args.tokens, tok, vocab, args.seed)
        masks = sorted(r.mask_s)
        compile_ms = sorted(1e3 * s for s in r.compile_s) or [float("nan")]

        def q(p: float, values: list[float] = masks) -> float:
            return 1e6 * values[min(len(values) - 1, int(p * len(values)))]

        print(
            f"{name:14} {setup:7.2f}  {statistics.median(compile_ms):14.2f}  {compile_ms[-1]:14.1f}"
            f"  {1e6 * statistics.fmean(masks):12.1f}  {q(0.5):5.1f}  {q(0.99):5.1f}"
            f"  {len(masks):6}  {r.failed:6}  {r.finished:8}  {r.valid:5}"
        )


if __name__ == "__main__":
    main()
