"""test_prompt: how a model ranks an answer after a prompt (TransformerLens'
utils.test_prompt).

    dclens.test_prompt(model, "The Eiffel Tower is in the city of", "Paris")

prints, for each token of the answer, its rank and probability at the
position that predicts it and the model's top tokens there, and returns the
numbers. TransformerLens' argument order (prompt, answer, model) works too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core.checks import Error, check_index
from ..model import Model


class AnswerToken(NamedTuple):
    """One answer token as the model saw it."""

    token: str
    rank: int  # 0 = the model's top token
    prob: float
    logit: float
    top: list[tuple[str, float]]  # the top-k tokens and their probabilities


def _softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def test_prompt(
    model, prompt, answer, *, prepend_space_to_answer: bool = True, top_k: int = 10, print_details: bool = True
) -> list[AnswerToken]:
    """Rank and probability of each token of `answer` after `prompt`, with the model's
    top tokens at each step; printed, and returned.

    The answer is tokenised after the prompt (on its own when the prompt's tokens change
    with it), and one forward pass gives the logits at each position that predicts an
    answer token. TransformerLens' argument order (prompt, answer, model) works too.

    Parameters
    ----------
    model : dclens.Model
        The model.
    prompt : str
        The prompt (non-empty).
    answer : str
        The answer that should follow it (not blank).
    prepend_space_to_answer : bool
        Put a space before the answer unless it starts with one.
    top_k : int
        How many of the model's top tokens to give at each step, in [1, vocab].
    print_details : bool
        Print the prompt's tokens and, per answer token, its rank, probability, logit
        and the top tokens.

    Returns
    -------
    list of AnswerToken
        One per answer token: the token's text, its rank (0: the model's top token), its
        probability and logit, and the top_k (token text, probability) pairs.

    Raises
    ------
    dclens.Error
        No dclens.Model among the arguments, an empty prompt or blank answer, or a top_k
        that is not an integer in [1, vocab].
    """
    if not isinstance(model, Model) and isinstance(answer, Model):  # TransformerLens' order
        prompt, answer, model = model, prompt, answer
    if not isinstance(model, Model):
        raise Error("test_prompt: give a dclens.Model (test_prompt(model, prompt, answer))")
    if not isinstance(prompt, str) or not prompt or not isinstance(answer, str) or not answer.strip():
        raise Error("test_prompt: prompt and answer must be non-empty strings")
    top_k = check_index("test_prompt: top_k", top_k, 1, model.config.vocab + 1)
    if prepend_space_to_answer and not answer.startswith(" "):
        answer = " " + answer
    p_ids = model.to_tokens(prompt)
    full = model.to_tokens(prompt + answer)
    if len(full) <= len(p_ids) or not np.array_equal(full[: len(p_ids)], p_ids):
        full = np.concatenate([p_ids, model.to_tokens(answer)])  # the answer tokenised on its own
    a_ids = full[len(p_ids) :]
    logits = model.forward(full[:-1], logits_at=np.arange(len(p_ids) - 1, len(full) - 1))  # [A, V]
    out = []
    for i, tok in enumerate(a_ids):
        pr = _softmax(logits[i])
        order = np.argsort(-pr, kind="stable")
        rank = int(np.nonzero(order == tok)[0][0])
        top = [(str(model.to_string([int(t)])), float(pr[t])) for t in order[:top_k]]
        out.append(AnswerToken(str(model.to_string([int(tok)])), rank, float(pr[tok]), float(logits[i][tok]), top))
    if print_details:
        print("Prompt: %r" % (model.to_str_tokens(p_ids),))
        print("Answer: %r (%d token%s)" % (answer, len(a_ids), "" if len(a_ids) == 1 else "s"))
        for a in out:
            print("Rank %d: %r  p = %.4f  logit = %.3f" % (a.rank, a.token, a.prob, a.logit))
            print("  top %d: %s" % (top_k, ", ".join("%r %.3f" % tp for tp in a.top)))
    return out


test_prompt.__test__ = False  # type: ignore[attr-defined]  # pytest's flag on a function: not a pytest test when imported into a test module
