"""Speculative decoding: drafters, the acceptance rule and the draft length (docs/speculative.md).

config.py (``--speculative``), state.py (per sequence), drafters.py, cost.py (the draft length),
speculator.py (what the scheduler calls); the acceptance rule itself is ``sampling/acceptance.py``.

A decoding sequence that speculates runs, in one step of the target model, its last token plus
``k`` drafted tokens at the positions after it; the target's logits at those ``k + 1`` rows decide
how many drafts are accepted, and one more token (the target's own, at the first rejected row or
after the last draft) is always produced. The KV positions of rejected drafts are simply written
again by later steps (``Scheduler`` only counts accepted positions as computed).

- ``NgramDrafter``: prompt lookup (an earlier occurrence of the sequence's last n tokens, n = 3, 2,
  1, in its prompt and output: for n = 3 the one with the longest agreeing run before it, else the
  most recent; what follows it is the draft), falling back to an n-gram table shared by all
  requests (llama.cpp's ``ngram-mod``). No second model.
- ``DraftModelDrafter``: a second compiled artifact with the same vocabulary (e.g. the int4 build
  of the target) drafts greedily, batched over the speculating sequences, with its own KV cache.
- Acceptance: greedy requests accept a draft while it equals the target's argmax, so the output is
  the non-speculative one token for token. Sampled requests use the standard rejection rule for a
  deterministic drafter: accept draft ``d`` with probability ``p(d)``, otherwise sample from ``p``
  with ``d`` removed; every emitted token is then distributed exactly as ``p`` says.
- ``CostModel``: the target's step time for T = 1..16 tokens (and a few more), measured at load;
  the draft length of each sequence is picked from it and the sequence's running acceptance rates
  of the draft's source (first draft; each draft after an accepted one), and is 0 (no drafting)
  where drafting does not pay.
"""
from .config import SpeculativeConfig, SpeculativeError, parse_speculative
from .cost import COST_OBSERVE_RATE, MEASURED_T, CostModel, choose_lengths
from .drafters import DraftModelDrafter, NgramDrafter, run_before
from .speculator import SpecStats, Speculator
from .state import MATCH_CLASSES, SOURCE_DRAFT, SOURCE_TABLE, SpecState

__all__ = ["COST_OBSERVE_RATE", "MATCH_CLASSES", "MEASURED_T", "SOURCE_DRAFT", "SOURCE_TABLE", "CostModel",
           "DraftModelDrafter", "NgramDrafter", "SpecState", "SpecStats", "SpeculativeConfig", "SpeculativeError",
           "Speculator", "choose_lengths", "parse_speculative", "run_before"]
