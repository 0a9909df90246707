"""The task-vocabulary BPE (synth_tasks/data/tokenizer.json) and the benchmark scoring with it."""

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from synth_tasks import evaluate, load_dataset
from synth_tasks.corpus import HELDOUT_FILE, TOKENIZER_FILE
from synth_tasks.fit_tokenizer import SPECIAL, stats
from synth_tasks.fit_tokenizer import main as tok_main
from synth_tasks.tokenize import tokenize_lines

from conftest import shared_path


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(TOKENIZER_FILE)


@pytest.fixture(scope="module")
def published():
    return load_dataset(shared_path("data", "synthetic_dataset.jsonl")).lines


def test_shipped_tokenizer_is_reproduced_by_its_command(tmp_path):
    out = tmp_path / "tokenizer.json"
    assert tok_main(["fit", str(out)]) == 0
    assert out.read_bytes() == Path(TOKENIZER_FILE).read_bytes()


def test_byte_level_like_gpt_neox(tok):
    assert tok.token_to_id(SPECIAL) == 0  # also the evaluator's padding id
    assert 2048 <= tok.get_vocab_size() <= 4096
    for s in ["\n< Ruth has a taxi. >. Ruth does not have a kind of vehicle\n", "zebra-ñ ☃ 42"]:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids) == s  # any text round-trips (bytes fallback)


@pytest.mark.parametrize("which", ["published", "heldout"])
def test_answers_mostly_single_tokens(tok, published, which):
    lines = published if which == "published" else load_dataset(HELDOUT_FILE).lines
    st = stats(tok, lines)
    assert st["single_token_answers"] > 0.9
    assert 150 < st["tokens_per_line_mean"] < 250
    # only multi-word and hyphenated answers take more than one token
    assert all(" " in w or "-" in w for w in st["multi_token_answer_words"])
    assert st["segmentwise_equals_whole_text"] == 1.0


class Oracle:
    """forward() puts the highest logit on the true next token (or, wrong=True,
    on the token after it): the benchmark must then score 100% (0%)."""

    def __init__(self, vocab, wrong=False):
        self.vocab, self.wrong, self.name = vocab, wrong, "oracle"

    def forward(self, ids):
        B, T = ids.shape
        out = np.zeros((B, T, self.vocab), np.float32)
        nxt = np.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
        if self.wrong:
            nxt = (nxt + 1) % self.vocab
        np.put_along_axis(out, nxt[..., None].astype(np.int64), 30.0, axis=2)
        return out


def test_benchmark_scores_answers_with_this_tokenizer(tok, published):
    lines = published[::37]
    for tl in tokenize_lines(lines, tok):
        for a, (s, e) in zip(tl.line.answers, tl.spans):
            assert tok.decode(tl.ids[s:e].tolist()) == " " + a.text
    V = tok.get_vocab_size()
    good = evaluate(Oracle(V), lines, tokenizer=tok)
    assert good.overall["acc"] == 1.0 and good.overall["ppl"] < 1.0001
    assert all(r.pred_text == " " + r.answer for r in good.answers)
    bad = evaluate(Oracle(V, wrong=True), lines, tokenizer=tok)
    assert bad.overall["acc"] == 0.0 and bad.overall["ppl"] > 1e6
