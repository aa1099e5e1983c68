#!/usr/bin/env python3
"""Reference data for tests/models/test_t5_tokenizer_unit.cpp: a tiny SentencePiece *unigram* model
trained here (T5 v1.1's tokenizer kind: pad 0, eos 1, unk 2, no bos, the "nmt_nfkc" normalisation)
and what sentencepiece and transformers' T5 tokenizer (the `tokenizers`-backed fast one) return.

Writes
  tests/data/ref/tiny-t5-tokenizer/spiece.model   the SentencePiece ModelProto (~240 KB, nearly all
      of it the nmt_nfkc precompiled charsmap)
  tests/data/ref/tiny-t5-tokenizer/tokenizer.json (+ tokenizer_config.json): what transformers 5's
      T5Tokenizer converts from a folder holding only spiece.model, extra_ids=100 (400 pieces + 100
      <extra_id_N>), saved with save_pretrained: normalizer Precompiled, pre_tokenizer
      Sequence[WhitespaceSplit, Metaspace("▁", always, split)], post-processor "$A </s>".
  tests/data/ref/t5_tokenizer_cases.json:
      {"max_length": 64, "vocab_size": 400, "cases": [{"text", "ids_sentencepiece", "ids_transformers",
                                                       "ids_transformers_unpadded", "agree"}...]}
  ids_sentencepiece  = sp.encode(text) + [1]    (eos appended, no padding)
  ids_transformers   = tok(text, max_length=64, padding="max_length", truncation=True).input_ids
  ids_transformers_unpadded = tok(text).input_ids
  agree              = ids_sentencepiece == ids_transformers_unpadded

Cases: 25 written out (empty, white space only, runs/tabs/newlines/CRLF, leading/trailing spaces,
full-width letters, ligatures, precomposed and combining accents, CJK, Hangul, unknown emoji and
symbols, digits, punctuation, special-token text, NBSP/em/ideographic/zero-width spaces, a prompt of
110+ tokens) and 24 random mixes (fixed seed) of corpus words with odd white space, NFKC-affected
characters, combining marks, Hangul jamo sequences, emoji with modifiers and flags.

The training corpus is generated here from a fixed seed (English, accented Latin, a little CJK,
digits, punctuation; no emoji, so emoji are unknown to the model). Training runs single-threaded;
rerunning gives byte-identical files with sentencepiece 0.2.3 / transformers 5.24 / tokenizers 0.23.

Where the two libraries disagree (printed by the script, "agree": false in the JSON): only
  * a special token's text inside the prompt ("</s>", "<extra_id_0>"): transformers splits it out as
    that token's id; sentencepiece tokenises its characters. Flux prompts rely on neither.
All other 48 cases agree, including white-space runs, tabs/newlines, NFKC and unknown characters.

Usage: python3 tools/ref/gen_t5_tokenizer_ref.py [out_dir]      (default tests/data/ref)
"""
import io
import json
import os
import random
import shutil
import sys
import tempfile

import sentencepiece as spm
from transformers import T5Tokenizer

MAX_LENGTH = 64

WORDS = ("a photo of the cat dog sitting on wooden table in bright sunlight portrait woman man "
         "landscape mountain river forest city night street painting oil watercolor highly detailed "
         "sharp focus cinematic lighting red blue green yellow black white small large old young "
         "beautiful castle ocean beach sunset cloud sky flower garden house window door car train "
         "running jumping standing holding looking smiling with and or by from under over near").split()
ACCENTED = "café naïve résumé façade jalapeño über straße crème brûlée São Paulo Zürich déjà vu élan".split()
CJK = ["猫", "犬", "山", "川", "東京", "日本", "写真", "中国", "你好", "世界", "こんにちは", "ねこ", "카페"]
PUNCT = [",", ".", "!", "?", ":", ";", "(", ")", "-", "'", '"', "/", "&", "%", "#", "+", "="]


def corpus(seed=0, lines=600):
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 14)
        toks = []
        for _ in range(n):
            r = rng.random()
            if r < 0.70:
                w = rng.choice(WORDS)
                toks.append(w.capitalize() if rng.random() < 0.15 else w)
            elif r < 0.80:
                toks.append(rng.choice(ACCENTED))
            elif r < 0.87:
                toks.append(rng.choice(CJK))
            elif r < 0.94:
                toks.append(str(rng.randint(0, 2024)))
            else:
                toks.append(rng.choice(PUNCT))
        out.append(" ".join(toks))
    return out


CASES = [
    "",
    " ",
    "     ",
    "\t\n ",
    "a photo of a cat",
    "A Photo Of A Cat",
    "  leading and trailing spaces   ",
    "multiple    spaces\tand\ttabs\nand\nnewlines\r\nwindows",
    "ｆｕｌｌ－ｗｉｄｔｈ　ｌｅｔｔｅｒｓ １２３",
    "ﬁne ﬂower ligatures ﬀ",
    "café naïve résumé façade",
    "cafe\u0301 combining acute",
    "crème brûlée in São Paulo, Zürich déjà vu",
    "東京の猫 and 中国 你好世界",
    "こんにちは 카페",
    "emoji 🐱🐶 cat 🎨!",
    "unknown run ☃☃☃ snow",
    "Ω ≈ ∑ µ ² ½ ™ ℃",
    "numbers 0123456789 2024 3.14159 1,000,000",
    "punctuation!?!... (quoted) \"double\" 'single' -- dash/slash; semi: colon",
    "a highly detailed oil painting of a castle by the river at sunset, cinematic lighting",
    "special token text </s> and <extra_id_0> inside",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    "zero\u200bwidth\u200cjoiner",
    ("a very long prompt that goes on and on: " +
     " ".join(["beautiful landscape with mountain river forest and sunset clouds, highly detailed"] * 6)),
]


def random_cases(seed=1, count=24):
    """Mixed strings for breadth: corpus words, odd white space, NFKC-affected and unknown characters,
    combining marks and Hangul jamo (where a grapheme-wise normaliser could differ)."""
    rng = random.Random(seed)
    extras = ["\t", "\n", "\r\n", "  ", "\u3000", "\u00a0", "\u200b", "\x07", "ﬁ", "ｗ", "①", "½", "e\u0301",
              "a\u0308\u0301", "\u1100\u1161", "\u1100\u1161\u11a8", "🐱", "👍🏽", "🇯🇵", "☃", "™", "…", "—", "«»",
              "Å", "Å", "ǅ", "ß", "İ", "ﾊﾟ", "㌀", "…"]
    pool = WORDS + ACCENTED + CJK + PUNCT
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts.append(rng.choice(extras) if rng.random() < 0.35 else rng.choice(pool))
            parts.append(rng.choice([" ", " ", " ", "", "  "]))
        out.append("".join(parts))
    return out


def main(out):
    folder = os.path.join(out, "tiny-t5-tokenizer")
    os.makedirs(folder, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, vocab_size=400, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name="nmt_nfkc",
        character_coverage=1.0, num_threads=1, seed_sentencepiece_size=100000, minloglevel=2)
    spm_path = os.path.join(folder, "spiece.model")
    with open(spm_path, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=spm_path)

    # transformers 5 converts a folder holding only spiece.model (T5Tokenizer(vocab_file=...) would
    # ignore the file and build a 4-piece vocabulary); extra_ids defaults to 100 as for T5 v1.1.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(spm_path, tmp)
        T5Tokenizer.from_pretrained(tmp).save_pretrained(folder)
    for name in os.listdir(folder):  # keep the files the test reads (+ transformers' config)
        if name not in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(folder, name))
    tok = T5Tokenizer.from_pretrained(folder)  # what a reader of the saved folder gets

    cases = []
    for text in CASES + random_cases():
        ids_sp = sp.encode(text) + [1]
        ids_tf = tok(text).input_ids
        padded = tok(text, max_length=MAX_LENGTH, padding="max_length", truncation=True).input_ids
        agree = ids_sp == ids_tf
        if not agree:
            print("disagree:", repr(text), "\n  sentencepiece", ids_sp, "\n  transformers ", ids_tf)
        cases.append({"text": text, "ids_sentencepiece": ids_sp, "ids_transformers": padded,
                      "ids_transformers_unpadded": ids_tf, "agree": agree})
    with open(os.path.join(out, "t5_tokenizer_cases.json"), "w", encoding="utf-8") as f:
        json.dump({"max_length": MAX_LENGTH, "vocab_size": sp.get_piece_size(), "cases": cases}, f,
                  ensure_ascii=False, indent=1)
        f.write("\n")
    print(len(cases), "cases;", sum(not c["agree"] for c in cases), "disagree; vocab", sp.get_piece_size(),
          "+", len(tok) - sp.get_piece_size(), "added")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")
