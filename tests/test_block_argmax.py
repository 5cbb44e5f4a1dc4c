"""spd.verify.sampling's argmax and top-2 margin over a large CPU vocabulary read block maxima first: they must return what
torch.argmax (lowest id on ties) and torch.topk return, bit for bit, ties and non-contiguous rows included."""

import pytest
import torch

from spd.verify.sampling import BLOCK, FEWEST, blocks_of, greedy_token, top2_margin


def _reference_margin(x: torch.Tensor) -> float:
    top = torch.topk(x.float(), 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("vocab", [49152, FEWEST])
def test_block_paths_equal_argmax_and_topk(vocab):
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        x = torch.randn(vocab, generator=generator) * 4
        if trial % 3 == 0:
            x = x.round()                               # many ties, in one block and across blocks
        if trial % 5 == 0:
            x[torch.randint(vocab, (2,), generator=generator)] = x.max() + 1     # a tie for the maximum
        assert blocks_of(x) is not None
        assert greedy_token(x) == int(torch.argmax(x)), trial
        assert top2_margin(x) == _reference_margin(x), trial
        half = x.to(torch.bfloat16)
        assert greedy_token(half) == int(torch.argmax(half)), trial
        assert top2_margin(half) == _reference_margin(half), trial


def test_the_maximum_twice_in_one_block_and_at_the_edges():
    x = torch.zeros(49152)
    x[[5, 9]] = 3.0
    assert greedy_token(x) == 5 and top2_margin(x) == 0.0
    x = torch.zeros(49152)
    x[-1], x[0] = 2.0, 1.5
    assert greedy_token(x) == 49151 and top2_margin(x) == 0.5
    x[BLOCK - 1] = 2.0                                  # the first block's last place ties the last place overall
    assert greedy_token(x) == BLOCK - 1 and top2_margin(x) == 0.0


def test_small_odd_and_strided_vocabularies_take_torch_itself():
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 2 * 49152, generator=generator)
    for x in (torch.randn(100, generator=generator), torch.randn(49152 + 7, generator=generator), rows[1, ::2]):
        assert blocks_of(x) is None
        assert greedy_token(x) == int(torch.argmax(x))
        assert top2_margin(x) == _reference_margin(x)
