"""A byte-level BPE tokenizer fitted to the task vocabulary (for the bundled models).

    tok = fit()   # tokenizers.Tokenizer
    tok.save("tokenizer.json")
    stats(tok, lines)   # tokens/line, share of single-token answers, ...

Like GPT-NeoX's tokenizer: a BPE model over bytes (``ByteLevel`` pre-tokenizer
without a prefix space, ``ByteLevel`` decoder), one special token
``<|endoftext|>`` (id 0, also the evaluator's padding id).  It is fitted on
lines of the *training* stream (:mod:`synth_tasks.corpus`, lines
``0 .. n_lines-1`` of stream ``seed``), never on the published file or the
held-out set.  Fitting is deterministic: the same command writes the same file.

Command line (``python -m synth_tasks.cli tokenizer ...``):
    tokenizer fit OUT.json [--vocab-size 4096] [--seed S] [--lines N]
    tokenizer stats TOKENIZER.json [--data FILE.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from .dataset import load_dataset
from .tokenize import tokenize_lines

TOKENIZER_SEED = 1
TOKENIZER_LINES = 2960  # 40 per task
VOCAB_SIZE = 4096  # an upper bound: the task vocabulary saturates at 2209 tokens
SPECIAL = "<|endoftext|>"


def fit(vocab_size: int = VOCAB_SIZE, seed: int = TOKENIZER_SEED, n_lines: int = TOKENIZER_LINES, texts=None):
    """Fit the BPE; ``texts`` (default: training-stream lines of ``seed``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if texts is None:
        from .corpus import training_texts

        texts = list(training_texts(seed=seed, stop=n_lines))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def stats(tok, lines) -> dict:
    """Token statistics of benchmark lines (synth_tasks Line objects) tokenised
    segment-wise: tokens per line, answer tokens, and the share of answers (and
    of distinct answer words) that are a single token."""
    tls = tokenize_lines(list(lines), tok)
    lens = np.array([len(t) for t in tls])
    n_ans = [e - s for t in tls for s, e in t.spans]
    words = {}
    for t in tls:
        for a, (s, e) in zip(t.line.answers, t.spans):
            words[a.text] = e - s
    whole = sum(1 for t in tls if list(t.ids) == tok.encode(t.line.text, add_special_tokens=False).ids)
    return {
        "vocab_size": tok.get_vocab_size(),
        "lines": len(tls),
        "tokens_per_line_mean": float(lens.mean()) if len(lens) else 0.0,
        "tokens_per_line_max": int(lens.max()) if len(lens) else 0,
        "answers": len(n_ans),
        "single_token_answers": float(np.mean(np.array(n_ans) == 1)) if n_ans else 0.0,
        "answer_tokens_mean": float(np.mean(n_ans)) if n_ans else 0.0,
        "distinct_answer_words": len(words),
        "single_token_answer_words": float(np.mean([v == 1 for v in words.values()])) if words else 0.0,
        "multi_token_answer_words": sorted(w for w, v in words.items() if v > 1),
        "segmentwise_equals_whole_text": whole / len(tls) if tls else 1.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m synth_tasks.cli tokenizer", description="Fit / measure the task-vocabulary BPE tokenizer."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit on training-stream lines and write tokenizer.json")
    f.add_argument("out")
    f.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    f.add_argument("--seed", type=int, default=TOKENIZER_SEED, help="training-stream seed")
    f.add_argument("--lines", type=int, default=TOKENIZER_LINES)
    s = sub.add_parser("stats", help="tokens/line and single-token answers on benchmark files")
    s.add_argument("tokenizer")
    s.add_argument("--data", action="append", default=None, help="benchmark JSONL (default: the published file)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "fit":
            if a.vocab_size < 257 or a.lines < 1:
                ap.error("--vocab-size must be > 256 and --lines >= 1")
            tok = fit(a.vocab_size, a.seed, a.lines)
            tok.save(a.out)
            print(
                f"wrote {a.out}: {tok.get_vocab_size()} tokens, fitted on training-stream lines "
                f"0..{a.lines - 1} of seed {a.seed}"
            )
        else:
            from tokenizers import Tokenizer

            from .dataset import default_data_path

            tok = Tokenizer.from_file(a.tokenizer)
            for path in a.data or [default_data_path()]:
                st = stats(tok, load_dataset(path).lines)
                print(json.dumps({"data": path, **st}, indent=1))
    except (OSError, ValueError) as e:
        print(f"tokenizer: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
        print(f"tokenizer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
