"""The boosted GPT-2's forward refuses a key/value cache that Colossal-AI's body would drop."""

from __future__ import annotations

import pytest
import torch

from colossal_hetero.policies.forwards import gpt2_lm_forward, refuse_cache


def test_a_non_empty_cache_is_one_clear_error():
    cache = ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)),)
    with pytest.raises(ValueError, match=r"^past_key_values: the boosted GPT-2 does not decode"):
        gpt2_lm_forward(None, torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
    refuse_cache(None)  # no cache: nothing to refuse
    refuse_cache(())  # an empty legacy cache is what Colossal-AI accepts too
