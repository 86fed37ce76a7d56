"""The SentencePiece references of graph/tests/sentencepiece.rs: two small BPE models trained by
Google's `sentencepiece` (PyPI) on the corpus below, written as the `tokenizer.ggml.*` metadata
llama.cpp's converter writes for them (convert_hf_to_gguf.py's `_set_vocab_sentencepiece`: each
piece's text, score and type from the model proto, BOS/EOS/UNK ids, `add_space_prefix` from the
normalizer's `add_dummy_prefix`), with sentencepiece's own ids and decodings of test texts.

- `llama.json`: Llama-style (a dummy `▁` prefix, words not split at spaces, a control symbol);
- `gemma.json`: Gemma-style (no dummy prefix, user-defined symbols matched in the raw text:
  newline runs and turn markers; llama.cpp also matches Gemma's runs of spaces there, which
  sentencepiece, escaping spaces first, never does, so the references hold none).

Both: identity normalization (no NFKC, spaces kept), byte fallback. Texts include characters the
models never saw (they fall back to `<0xXX>` pieces), runs of spaces and newlines.

Usage: python3 make_reference.py   (needs sentencepiece and protobuf; writes beside itself)
"""
import json
import os

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = """The capital of France is Paris. The capital of Italy is Rome.
A quick brown fox jumps over the lazy dog, and the dog sleeps on.
Compilers turn graphs into kernels; kernels run on processors.
Tokenizers split text into pieces, and pieces into ids.
Numbers like 12, 345 and 6789 appear in text too: 2024, 1999, 42.
She said: "Hello, world!" He answered: 'Good morning.'
  Indented lines keep their spaces, and    runs of spaces too.
Tabs\tand newlines\nare whitespace as well.
The model reads the prompt, then writes one token at a time.
Caching the keys and values of past tokens makes decoding fast.
Sliding windows limit how far back each layer can look.
"""


def train(name, **extra):
    lines = CORPUS.splitlines() * 20
    prefix = os.path.join(HERE, f"_{name}")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=700,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        hard_vocab_limit=False,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
        **extra,
    )
    with open(prefix + ".model", "rb") as f:
        data = f.read()
    os.remove(prefix + ".model")
    os.remove(prefix + ".vocab")
    return data


def reference(name, texts, **extra):
    data = train(name, **extra)
    proto = pb.ModelProto()
    proto.ParseFromString(data)
    sp = spm.SentencePieceProcessor(model_proto=data)
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
    }
    cases = []
    for text in texts:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    with open(os.path.join(HERE, f"{name}.json"), "w") as f:
        json.dump({"metadata": metadata, "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")


TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "kernels run on processors and the dog sleeps",
    "  two leading spaces, and    four inside",
    "trailing space ",
    "line one\nline two\n\nline four",
    "tabs\tand\t\ttabs",
    "unseen characters: ÿ, 日本語, and 🦀 fall back to bytes",
    "Zebra quizzes vex jumpy wizards: 0987654321.",
    "a",
    "",
]

reference("llama", TEXTS, split_by_whitespace=False, control_symbols=["<ctl>"])
reference(
    "gemma",
    TEXTS + ["<start_of_turn>user\nHi<end_of_turn>\n", "a  b   c\n\n\nd"],
    add_dummy_prefix=False,
    split_by_whitespace=False,
    user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "\n\n", "\n\n\n"],
)
