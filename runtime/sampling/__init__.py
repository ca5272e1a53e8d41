"""Choosing tokens from a step's logits, beside the scheduler (which decides what runs): the
request's ``SamplingParams`` (params.py), draws with the greedy fast path (draw.py), logprob
entries (logprobs.py), greedy and sampled acceptance of drafted tokens (acceptance.py), and the
grammar matchers whose masks are applied to the rows before any of them (grammar.py; the grammars
themselves are compiled by structured.py)."""
from .acceptance import accept_draft, accept_greedy, accept_sampled
from .draw import distribution, draw_rows, finite_at, sample
from .logprobs import LOGPROB_FLOOR, token_logprobs
from .params import GREEDY_BELOW, SEED_BOUND, SamplingParams

__all__ = ["GREEDY_BELOW", "LOGPROB_FLOOR", "SEED_BOUND", "SamplingParams", "accept_draft", "accept_greedy",
           "accept_sampled", "distribution", "draw_rows", "finite_at", "sample", "token_logprobs"]
